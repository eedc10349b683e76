"""Videos as uint8 frame arrays: a video sample is ``[F, H, W, 3]``, a batch ``[B, F, H, W, 3]``.

Everything that shows or stores pictures handles both ranks with these helpers: grids are laid out
along the width (``axis=-2``) and height (``axis=-3``) so that a grid of videos is a video (one
grid per frame); a picture with frames is written as an animated GIF (PIL) where an image is a PNG (``png_bytes``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

GIF_FPS = 8  # playback rate of the GIFs we write (Wan2.1 renders 16 fps; tiny clips read better slower)


def is_video_batch(samples: np.ndarray) -> bool:
    """``[B, F, H, W, 3]`` (videos) rather than ``[B, H, W, 3]`` (images)."""
    return np.asarray(samples).ndim == 5


def is_animated(picture: np.ndarray) -> bool:
    """One picture with frames ``[F, H, W, 3]`` rather than an image ``[H, W, 3]``."""
    return np.asarray(picture).ndim == 4


def side_by_side(samples: np.ndarray | list[np.ndarray]) -> np.ndarray:
    """Samples next to each other: ``[N, (F,) H, W, 3]`` -> ``[(F,) H, N*W, 3]``."""
    return np.concatenate(list(samples), axis=-2)


def stacked(rows: list[np.ndarray]) -> np.ndarray:
    """Pictures of equal width above each other: ``[(F,) H_i, W, 3]`` -> ``[(F,) sum H_i, W, 3]``."""
    return np.concatenate(rows, axis=-3)


def grid(samples: np.ndarray, cols: int) -> np.ndarray:
    """``[N, (F,) H, W, 3]`` -> one picture of ``cols`` columns (empty cells black)."""
    samples = np.asarray(samples)
    n = samples.shape[0]
    rows = (n + cols - 1) // cols
    padded = np.zeros((rows * cols, *samples.shape[1:]), dtype=np.uint8)
    padded[:n] = samples
    return stacked([side_by_side(padded[r * cols:(r + 1) * cols]) for r in range(rows)])


def gif_bytes(frames: np.ndarray, fps: int = GIF_FPS) -> bytes:
    """uint8 ``[F, H, W, 3]`` -> an animated GIF (looping)."""
    from PIL import Image

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {frames.shape}")
    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return buf.getvalue()


def png_bytes(image: np.ndarray, compress_level: int = 1) -> bytes:
    """Lossless PNG bytes of an RGB uint8 image: the one PNG encoder (trajectories, edit prompts, reports).

    OpenCV's encoder, not Pillow's: OpenCV lets go of the GIL while it encodes, so a writer thread
    does not hold up the training thread's Python (Pillow's encoder keeps the GIL). Any PNG reader
    (Pillow, ``data.images.decode_image``, ``read_frames``) reads the bytes back; the colour order is
    RGB like every PNG.

    Args:
        image (`np.ndarray`): uint8 ``[H, W, 3]``, RGB.
        compress_level (`int`, *optional*, defaults to 1): zlib level 0-9; 1 is much faster than
            Pillow's 6 for slightly larger files.

    Returns:
        `bytes`: the PNG file.
    """
    import cv2

    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 RGB image [H, W, 3], got {image.dtype} {image.shape}")
    bgr = np.ascontiguousarray(image[..., ::-1])  # OpenCV takes BGR
    ok, buf = cv2.imencode(".png", bgr, [cv2.IMWRITE_PNG_COMPRESSION, int(compress_level)])
    if not ok:
        raise ValueError(f"PNG encoding failed for an image of shape {image.shape}")
    return buf.tobytes()


def read_frames(source: str | Path | bytes) -> np.ndarray:
    """Every frame of a picture file as uint8 RGB: ``[H, W, 3]`` for a single-frame file (PNG),
    ``[F, H, W, 3]`` for an animated one (GIF)."""
    from PIL import Image, ImageSequence

    with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
        frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
    return frames[0] if len(frames) == 1 else np.stack(frames)


def picture_suffix(picture: np.ndarray) -> str:
    return ".gif" if is_animated(picture) else ".png"


def save_picture(picture: np.ndarray, path: str | Path) -> Path:
    """Write an image as PNG or frames as an animated GIF; the suffix of ``path`` is set to match."""
    path = Path(path).with_suffix(picture_suffix(picture))
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_animated(picture):
        path.write_bytes(gif_bytes(picture))
    else:
        path.write_bytes(png_bytes(picture))
    return path
