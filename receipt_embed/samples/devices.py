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
    The capture is ``width`` pixels wide and at least 1.25 times as tall. Harsher
    conditions (see :mod:`receipt_embed.samples.conditions`), off by default: ``fade`` pales
    the thermal ink (0..1), ``creases`` folds the paper that many times, ``cast_shadow``
    darkens part of the frame by that fraction, ``screenshot`` shows the photo on a phone
    screen, ``binarise`` thresholds it to black and white.
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
    fade: float = 0.0
    creases: int = 0
    cast_shadow: float = 0.0
    screenshot: bool = False
    binarise: bool = False


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


# capture styles no default device has (the first six): for a model to be tested on looks it
# was not trained on; see benchmarks/quality.py --leave-out-devices
HARSH_DEVICES: tuple[DeviceProfile, ...] = (
    DeviceProfile(
        name="faded_thermal",
        description="phone photo of an old thermal receipt, folded in the wallet: pale uneven ink, "
        "yellowed paper, creases, steep perspective, strong side light",
        width=288,
        fill=(0.62, 0.78),
        rotation_deg=6.0,
        tilt=0.16,
        corner_jitter=0.025,
        background="wood",
        background_rgb=(120, 84, 56),
        drop_shadow=0.5,
        light_gradient=0.55,
        vignette=0.3,
        defocus=(0.5, 1.0),
        motion=1.5,
        resolution=1.0,
        noise=3.0,
        chroma_noise=2.0,
        white_balance=(1.04, 1.0, 0.9),
        exposure=1.0,
        contrast=0.95,
        sharpen=20.0,
        grayscale=False,
        jpeg_quality=70,
        fade=0.65,
        creases=3,
    ),
    DeviceProfile(
        name="phone_shadow",
        description="phone held over the receipt under a ceiling lamp: the phone's hard shadow on "
        "part of the page, tilt, warm light",
        width=288,
        fill=(0.7, 0.85),
        rotation_deg=4.0,
        tilt=0.12,
        corner_jitter=0.02,
        background="laminate",
        background_rgb=(190, 180, 168),
        drop_shadow=0.4,
        light_gradient=0.35,
        vignette=0.2,
        defocus=(0.4, 0.9),
        motion=2.0,
        resolution=1.0,
        noise=4.0,
        chroma_noise=3.0,
        white_balance=(1.06, 1.0, 0.86),
        exposure=1.0,
        contrast=1.0,
        sharpen=30.0,
        grayscale=False,
        jpeg_quality=74,
        cast_shadow=0.55,
        creases=1,
    ),
    DeviceProfile(
        name="screenshot",
        description="screenshot of a receipt photo sent in a chat app: small on a dark screen "
        "between status and navigation bars, compressed twice over",
        width=256,
        fill=(0.8, 0.92),
        rotation_deg=2.0,
        tilt=0.05,
        corner_jitter=0.012,
        background="fabric",
        background_rgb=(150, 140, 120),
        drop_shadow=0.3,
        light_gradient=0.2,
        vignette=0.2,
        defocus=(0.3, 0.6),
        motion=0.0,
        resolution=0.8,
        noise=2.0,
        chroma_noise=1.5,
        white_balance=(1.0, 1.0, 0.95),
        exposure=1.02,
        contrast=1.05,
        sharpen=0.0,
        grayscale=False,
        jpeg_quality=62,
        screenshot=True,
    ),
    DeviceProfile(
        name="kiosk_bw",
        description="self-service kiosk scanner: thresholded to black and white, low resolution, "
        "slight skew, dark platen",
        width=256,
        fill=(0.86, 0.94),
        rotation_deg=2.0,
        tilt=0.0,
        corner_jitter=0.004,
        background="platen",
        background_rgb=(40, 40, 42),
        drop_shadow=0.0,
        light_gradient=0.1,
        vignette=0.0,
        defocus=(0.3, 0.6),
        motion=0.0,
        resolution=0.6,
        noise=3.0,
        chroma_noise=0.0,
        white_balance=(1.0, 1.0, 1.0),
        exposure=1.0,
        contrast=1.0,
        sharpen=0.0,
        grayscale=True,
        jpeg_quality=80,
        binarise=True,
    ),
    DeviceProfile(
        name="washed_scan",
        description="cheap sheet-fed scanner on a faded receipt: low contrast, bright, grey, streaks of uneven fading",
        width=272,
        fill=(0.9, 0.96),
        rotation_deg=1.0,
        tilt=0.0,
        corner_jitter=0.003,
        background="lid",
        background_rgb=(225, 225, 222),
        drop_shadow=0.05,
        light_gradient=0.05,
        vignette=0.0,
        defocus=(0.6, 1.0),
        motion=0.0,
        resolution=0.9,
        noise=2.0,
        chroma_noise=0.0,
        white_balance=(1.0, 1.0, 1.0),
        exposure=1.18,
        contrast=0.5,
        sharpen=0.0,
        grayscale=True,
        jpeg_quality=70,
        fade=0.4,
    ),
)
DEFAULT_DEVICE_COUNT = len(DEVICES)
DEVICES = DEVICES + HARSH_DEVICES


def select_devices(count: int) -> tuple[DeviceProfile, ...]:
    """The first ``count`` profiles of :data:`DEVICES`, so a larger set extends a smaller one."""
    if not 1 <= count <= len(DEVICES):
        raise BadInput(f"devices must be between 1 and {len(DEVICES)}, got {count}")
    return DEVICES[:count]
