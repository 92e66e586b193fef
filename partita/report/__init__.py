"""report: turn graphs, plans and measurements into text, JSON and pictures (types only in, no torch)."""
