"""Real training on torch.distributed: mesh, reference models, tensor/data/pipeline parallelism."""
