"""capture: an unmodified nn.Module + example inputs -> OpGraph (via torch.export, non-strict).

The captured computation is the *training* computation: forward up to the scalar loss,
either returned by the model itself (HF ``labels=``) or ``loss_fn(output, target)``.

``batch`` decides the batch dim of every input (declared, dim 0, or found by a probe export) and
widens an example batch of 1; ``samples`` reads the exported graph for operations that mix the
samples of the batch (along a wrong dim, or in a loss that couples them: ``OpGraph.couples_samples``).
"""

from partita.capturing.capture import capture
from partita.capturing.graph import canonical_names
from partita.types.graph import check_flat_inputs, exported_call_inputs, flatten_call_inputs

__all__ = ["canonical_names", "capture", "check_flat_inputs", "exported_call_inputs", "flatten_call_inputs"]
