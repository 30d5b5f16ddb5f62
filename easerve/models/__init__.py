"""Model adapters. Importing this package registers the Ultravox classes with the
transformers Auto* factories, so `AutoConfig/AutoModel/AutoProcessor.from_pretrained`
load an Ultravox folder without trust_remote_code. On a transformers release without the
config API those classes are written for (`SubConfigSpec`, 5.24), the other families still
load and `ULTRAVOX_UNAVAILABLE` says why Ultravox does not."""
try:
    from easerve.models import ultravox_hf  # noqa: F401  (registration side effect)
    ULTRAVOX_UNAVAILABLE = ""
except ImportError as exc:  # pragma: no cover - older transformers (the GPU image's 5.17)
    ULTRAVOX_UNAVAILABLE = f"Ultravox needs transformers >= 5.24 ({exc})"
from easerve.models.registry import UnsupportedModelError, detect_family  # noqa: F401
from easerve.models.loader import load_adapter  # noqa: F401
