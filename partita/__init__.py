"""partita: plan and train PyTorch models too large for one device.

capture -> cost -> plan -> runtime; see DESIGN.md in the project's shared folder.
"""

from partita.capture import capture
from partita.errors import CaptureError, InputError, ModelSpecError, PartitaError
from partita.types import GraphInput, OpGraph, OpNode, ParamInfo, TensorInfo

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "GraphInput",
    "InputError",
    "ModelSpecError",
    "OpGraph",
    "OpNode",
    "ParamInfo",
    "PartitaError",
    "TensorInfo",
    "capture",
]
