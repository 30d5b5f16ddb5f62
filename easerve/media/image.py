"""Images: encoded bytes / base64 / data: URI -> PIL.Image in RGB, size checked before decoding."""
from __future__ import annotations

import io

from easerve.media.common import PixelBudget, check_size, to_bytes
from easerve.errors import MediaError

IMAGE_FORMATS = "PNG, JPEG, WebP, GIF, BMP or TIFF"


def open_image(raw: bytes, what: str, max_side: int):
    """PIL.Image.open (reads the header only) with the size checked."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(raw))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{what} could not be decoded ({type(e).__name__}); send a {IMAGE_FORMATS} file") from None
    check_size(*im.size, what, max_side)
    return im


def to_rgb(im, what: str):
    try:
        im.load()
        return im.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"{what} is truncated or corrupt ({e}); send a complete {IMAGE_FORMATS} file") from None


def decode_image(data: bytes | str, max_side: int = 8192, what: str = "image",
                 budget: PixelBudget | None = None):
    """bytes / base64 / data: URI -> PIL.Image in RGB; its pixels are charged to `budget` first."""
    return decode_opened(open_image(to_bytes(data, what), what, max_side), what, budget)


def decode_opened(im, what: str = "image", budget: PixelBudget | None = None):
    """An `open_image` result -> PIL.Image in RGB; its pixels are charged to `budget` first."""
    if budget is not None:
        budget.take(im.size[0] * im.size[1], f"{what} ({im.size[0]}x{im.size[1]})")
    return to_rgb(im, what)
