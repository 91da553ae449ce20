"""Simulated capture devices: each one a consistent look that an encoder could latch onto.

A real collection mixes phones, scanners and webcams, and every device leaves the same
fingerprint on all its captures: colour cast, sharpness, noise, JPEG quality, the surface
the paper lies on. An embedding that clusters by that fingerprint has learned *which device*
instead of *which receipt*; ``audit-shortcuts`` must catch it. The profiles are therefore
deliberately distinct. A profile fixes the look; per-capture randomness (exact angle,
perspective, blur amount, noise) is drawn within its ranges by
:func:`receipt_embed.samples.capture.simulate_capture`.
"""

from __future__ import annotations

from dataclasses import dataclass

from receipt_embed.errors import BadInput


@dataclass(frozen=True)
class DeviceProfile:
    """How one device photographs or scans a receipt.

    Geometry: the paper fills ``fill`` (a range) of the frame width; it is rotated with a
    standard deviation of ``rotation_deg``; ``tilt`` narrows the top edge by that fraction
    of the paper width (a camera leaning back) and ``corner_jitter`` moves each corner by
    that fraction (standard deviation). Scene: ``background`` names a surface texture
    (see :mod:`receipt_embed.samples.backgrounds`) of colour ``background_rgb``; the paper
    casts a ``drop_shadow``; ``light_gradient`` darkens one side of the frame and
    ``vignette`` the corners (0..1). Optics and sensor: Gaussian ``defocus`` radius (a
    range, pixels), ``motion`` blur up to that many pixels, sensor ``resolution`` relative
    to the output (below 1 looks soft and blocky), luminance ``noise`` and ``chroma_noise``
    standard deviations (0..255). Processing: ``white_balance`` channel gains (the colour
    cast), ``exposure`` gain, ``contrast`` around mid-grey, ``sharpen`` (unsharp-mask
    percent), ``grayscale`` output, and the ``jpeg_quality`` the file is saved with.
    The capture is ``width`` pixels wide and at least 1.25 times as tall.
    """

    name: str
    description: str
    width: int
    fill: tuple[float, float]
    rotation_deg: float
    tilt: float
    corner_jitter: float
    background: str
    background_rgb: tuple[int, int, int]
    drop_shadow: float
    light_gradient: float
    vignette: float
    defocus: tuple[float, float]
    motion: float
    resolution: float
    noise: float
    chroma_noise: float
    white_balance: tuple[float, float, float]
    exposure: float
    contrast: float
    sharpen: float
    grayscale: bool
    jpeg_quality: int


DEVICES: tuple[DeviceProfile, ...] = (
    DeviceProfile(
        name="phone_a",
        description="phone under warm indoor light over a wooden table: orange cast, soft focus, "
        "noise, dark corners, moderate tilt",
        width=288,
        fill=(0.76, 0.86),
        rotation_deg=2.5,
        tilt=0.06,
        corner_jitter=0.012,
        background="wood",
        background_rgb=(138, 94, 58),
        drop_shadow=0.45,
        light_gradient=0.25,
        vignette=0.35,
        defocus=(0.9, 1.4),
        motion=0.0,
        resolution=1.0,
        noise=4.0,
        chroma_noise=2.5,
        white_balance=(1.08, 1.0, 0.8),
        exposure=0.95,
        contrast=0.9,
        sharpen=0.0,
        grayscale=False,
        jpeg_quality=72,
    ),
    DeviceProfile(
        name="phone_b",
        description="phone in cool daylight over a dark slate desk: blue cast, steep perspective, "
        "hard contrast, over-sharpened, slight hand shake",
        width=288,
        fill=(0.68, 0.8),
        rotation_deg=4.0,
        tilt=0.1,
        corner_jitter=0.02,
        background="slate",
        background_rgb=(50, 55, 62),
        drop_shadow=0.6,
        light_gradient=0.15,
        vignette=0.15,
        defocus=(0.0, 0.4),
        motion=3.0,
        resolution=1.0,
        noise=1.5,
        chroma_noise=1.0,
        white_balance=(0.88, 0.98, 1.12),
        exposure=1.05,
        contrast=1.25,
        sharpen=80.0,
        grayscale=False,
        jpeg_quality=66,
    ),
    DeviceProfile(
        name="scanner",
        description="flatbed scanner: square-on, even light, grayscale, white lid around the "
        "paper, sharp, clean, high JPEG quality",
        width=272,
        fill=(0.9, 0.95),
        rotation_deg=0.8,
        tilt=0.0,
        corner_jitter=0.002,
        background="lid",
        background_rgb=(232, 232, 228),
        drop_shadow=0.1,
        light_gradient=0.0,
        vignette=0.0,
        defocus=(0.3, 0.5),
        motion=0.0,
        resolution=1.0,
        noise=1.0,
        chroma_noise=0.0,
        white_balance=(1.0, 1.0, 1.0),
        exposure=1.08,
        contrast=1.15,
        sharpen=0.0,
        grayscale=True,
        jpeg_quality=76,
    ),
    DeviceProfile(
        name="webcam",
        description="webcam over a beige fabric mat: low resolution upscaled, green fluorescent "
        "cast, dull, heavy noise, strong JPEG compression",
        width=256,
        fill=(0.8, 0.9),
        rotation_deg=1.5,
        tilt=0.03,
        corner_jitter=0.01,
        background="fabric",
        background_rgb=(176, 160, 132),
        drop_shadow=0.3,
        light_gradient=0.3,
        vignette=0.25,
        defocus=(0.5, 0.9),
        motion=0.0,
        resolution=0.6,
        noise=6.0,
        chroma_noise=4.0,
        white_balance=(0.94, 1.06, 0.9),
        exposure=0.88,
        contrast=0.8,
        sharpen=0.0,
        grayscale=False,
        jpeg_quality=55,
    ),
    DeviceProfile(
        name="phone_c",
        description="phone in dim light on a pale laminate counter: dark, yellow, motion blur "
        "from a slow shutter, heavy noise",
        width=288,
        fill=(0.72, 0.84),
        rotation_deg=3.0,
        tilt=0.08,
        corner_jitter=0.015,
        background="laminate",
        background_rgb=(206, 200, 190),
        drop_shadow=0.3,
        light_gradient=0.4,
        vignette=0.3,
        defocus=(0.4, 0.8),
        motion=4.0,
        resolution=0.85,
        noise=8.0,
        chroma_noise=5.0,
        white_balance=(1.1, 1.0, 0.72),
        exposure=0.75,
        contrast=0.85,
        sharpen=40.0,
        grayscale=False,
        jpeg_quality=72,
    ),
    DeviceProfile(
        name="copier",
        description="office copier: black and white with very hard contrast, dark platen "
        "around the paper, slight skew, low resolution, low JPEG quality",
        width=272,
        fill=(0.88, 0.95),
        rotation_deg=1.2,
        tilt=0.0,
        corner_jitter=0.003,
        background="platen",
        background_rgb=(62, 62, 64),
        drop_shadow=0.0,
        light_gradient=0.0,
        vignette=0.0,
        defocus=(0.2, 0.4),
        motion=0.0,
        resolution=0.7,
        noise=2.0,
        chroma_noise=0.0,
        white_balance=(1.0, 1.0, 1.0),
        exposure=1.05,
        contrast=1.5,
        sharpen=0.0,
        grayscale=True,
        jpeg_quality=60,
    ),
)


def select_devices(count: int) -> tuple[DeviceProfile, ...]:
    """The first ``count`` profiles of :data:`DEVICES`, so a larger set extends a smaller one."""
    if not 1 <= count <= len(DEVICES):
        raise BadInput(f"devices must be between 1 and {len(DEVICES)}, got {count}")
    return DEVICES[:count]
