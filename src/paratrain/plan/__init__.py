"""Search for the fastest memory-feasible configuration."""
