"""cost: what every node costs in time and memory (measured or analytic), and the comm model."""
