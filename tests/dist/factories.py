"""Factory files for `partita train path/to/file.py:factory` tests: models no zoo entry builds."""

import torch


def hf_resnet():
    """HF ResNet: basic blocks whose residual is added in place (``hidden += residual``) and BatchNorm."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    model = ResNetForImageClassification(config)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(4, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 3, (4,), generator=generator)
    return model, {"pixel_values": pixels, "labels": labels}
