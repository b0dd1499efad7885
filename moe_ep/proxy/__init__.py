"""Host proxy for peers on other nodes (inter-node path); not built yet."""
