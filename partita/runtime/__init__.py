"""runtime: build stage modules from a Plan and train them on torch.distributed."""
