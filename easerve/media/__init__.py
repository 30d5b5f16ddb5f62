"""Decoding user media at the gateway: images, videos and audio into what HF processors take,
and fetching media by URL under a host policy.

Every failure raises `easerve.errors.MediaError` (an InvalidRequest) saying what is wrong and what is
accepted, so the gateway can return it to the client as INVALID_ARGUMENT / HTTP 400 unchanged.

- `common`: inline payloads (bytes / base64 / data: URIs), MediaLimits, PixelBudget
- `image`, `video` (PIL + PyAV, VideoSampling), `audio` (PyAV + soxr)
- `fetch`: MediaFetcher (http(s) and file:// under FetchConfig)
- `resolve`: MediaResolver of `easerve.types.MediaRef`s (fetch async, decode in a worker thread)
"""
from easerve.media.audio import AUDIO_ACCEPTS, decode_audio, resample
from easerve.media.common import MediaLimits, PixelBudget, is_url, to_bytes
from easerve.media.fetch import FetchConfig, MediaFetcher
from easerve.media.image import IMAGE_FORMATS, decode_image
from easerve.media.resolve import MediaConfig, MediaResolver, config_for
from easerve.media.video import VIDEO_ACCEPTS, DecodedVideo, VideoSampling, decode_video, decode_video_file

__all__ = ["AUDIO_ACCEPTS", "IMAGE_FORMATS", "VIDEO_ACCEPTS", "DecodedVideo", "FetchConfig", "MediaConfig",
           "MediaFetcher", "MediaLimits", "MediaResolver", "PixelBudget",
           "VideoSampling", "config_for", "decode_audio", "decode_image", "decode_video", "decode_video_file",
           "is_url", "resample", "to_bytes"]
