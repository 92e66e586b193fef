"""plan: chain coarsening, the joint search, the schedule simulator and baselines."""
