"""What every other folder stands on: errors, settings, tuning, group, node memory, workspace."""
