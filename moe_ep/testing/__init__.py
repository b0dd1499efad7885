"""What checks moe_ep: the pure-torch oracle; recorded launches compiled for a GPU target."""
