"""Roofline model of a multimodal LLM on a device: FLOPs and bytes of each layer of the vision /
audio tower, projector and language model, read from the checkpoint's config.json (no torch,
no weights), turned into seconds by a device spec (`spec.py`) and its stated efficiency factors.
`rows.py` gives the embedding rows each media size yields, by the family's processor rules."""
from easerve.roofline.cost import Cost
from easerve.roofline.models import ModelArch, load_arch
from easerve.roofline.spec import DeviceSpec, load_spec, spec_names

__all__ = ["Cost", "DeviceSpec", "ModelArch", "load_arch", "load_spec", "spec_names"]
