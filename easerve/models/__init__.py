"""Model adapters. Importing this package registers the Ultravox classes with the
transformers Auto* factories, so `AutoConfig/AutoModel/AutoProcessor.from_pretrained`
load an Ultravox folder without trust_remote_code."""
from easerve.models import ultravox_hf  # noqa: F401  (registration side effect)
from easerve.models.registry import UnsupportedModelError, detect_family, load_adapter  # noqa: F401
