"""Rendering: print a :class:`Receipt` onto a strip of paper, as a thermal printer would.

The output is a flat, upright "scan" of the receipt (RGB, off-white paper, grey-black
ink), as tall as its content: more items, taller paper. It carries no capture effects;
those come from :func:`receipt_embed.samples.capture.simulate_capture`, which takes any
scan, rendered or real. Text uses Pillow's bundled FreeType font, so rendering needs no
font files and gives the same pixels wherever the same Pillow version runs.
"""

from __future__ import annotations

import re
from functools import cache

from PIL import Image, ImageDraw, ImageFont

from receipt_embed.samples.receipts import Receipt, format_money

_STRIP_HEIGHT = 3000  # longer than any receipt; cropped to the printed length
_LINE_SPACING = 1.3
PRINTED_FIELDS = ("date", "total", "receipt_number")  # what printed_fields() returns, in this order
# where a shop's date format turns to the time of day: "%d/%m/%Y %H:%M" prints the date "%d/%m/%Y"
_TIME_PART = re.compile(r"\s*%[HIMSpX].*$")


@cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def _fit(text: str, size: int, room: float) -> str:
    """Shorten ``text`` until it fits in ``room`` pixels, as printers truncate names."""
    font = _font(size)
    while text and font.getlength(text) > room:
        text = text[:-1]
    return text


def _margin(width: int) -> int:
    return width // 16


def _date_line(receipt: Receipt) -> str:
    return receipt.issued.strftime(receipt.shop.date_format)


def _total_text(receipt: Receipt) -> str:
    return f"{receipt.shop.currency} {format_money(receipt.total_cents)}"


def printed_fields(receipt: Receipt) -> dict[str, str]:
    """The ``date``, ``total`` and ``receipt_number`` exactly as :func:`render_receipt` prints them:
    the date as the shop's format prints it, without the time of day that follows it on the same
    line (``05/25/2023`` of ``05/25/2023 02:14 PM``; ``""`` if the line were cut short before the date's
    end); the total's amount with its currency (``GBP 12.34``); the receipt number line as printed
    (``Order #01234  Till 05``), cut where the paper's width cuts it."""
    shop = receipt.shop
    room = shop.paper_width - 2 * _margin(shop.paper_width)
    line = _fit(_date_line(receipt), shop.body_size, room)
    date = receipt.issued.strftime(_TIME_PART.sub("", shop.date_format))
    return {
        "date": date if line.startswith(date) else "",
        "total": _total_text(receipt),
        "receipt_number": _fit(receipt.number, shop.body_size, room),
    }


class _Printer:
    """Prints lines top to bottom on a long strip, then tears it off below the last one."""

    def __init__(self, width: int, paper_rgb: tuple[int, int, int], ink: int):
        self.image = Image.new("RGB", (width, _STRIP_HEIGHT), paper_rgb)
        self.draw = ImageDraw.Draw(self.image)
        self.paper = paper_rgb
        self.ink = (ink, ink, ink)
        self.margin = _margin(width)
        self.left = self.margin
        self.right = width - self.margin
        self.y = self.margin

    def _x(self, align: str) -> tuple[float, str]:
        return {"left": (self.left, "la"), "center": ((self.left + self.right) / 2, "ma")}[align]

    def text(self, text: str, size: int, align: str = "left", bold: bool = False) -> None:
        x, anchor = self._x(align)
        text = _fit(text, size, self.right - self.left)
        self.draw.text((x, self.y), text, font=_font(size), fill=self.ink, anchor=anchor, stroke_width=int(bold))
        self.y += round(size * _LINE_SPACING)

    def pair(self, left: str, right: str, size: int, indent: int = 0, bold: bool = False) -> None:
        """A label on the left, an amount right-aligned on the same line."""
        font = _font(size)
        room = self.right - self.left - indent - font.getlength(right) - size
        self.draw.text(
            (self.left + indent, self.y),
            _fit(left, size, room),
            font=font,
            fill=self.ink,
            anchor="la",
            stroke_width=int(bold),
        )
        self.draw.text((self.right, self.y), right, font=font, fill=self.ink, anchor="ra", stroke_width=int(bold))
        self.y += round(size * _LINE_SPACING)

    def row(self, cells: tuple[str, str, str], size: int, name_x: int) -> None:
        """A three-column table row: quantity, name at ``name_x``, right-aligned amount."""
        qty, name, amount = cells
        font = _font(size)
        room = self.right - self.left - name_x - font.getlength(amount) - size
        self.draw.text((self.left, self.y), qty, font=font, fill=self.ink, anchor="la")
        self.draw.text((self.left + name_x, self.y), _fit(name, size, room), font=font, fill=self.ink, anchor="la")
        self.draw.text((self.right, self.y), amount, font=font, fill=self.ink, anchor="ra")
        self.y += round(size * _LINE_SPACING)

    def separator(self, style: str, size: int) -> None:
        if style == "rule":
            middle = self.y + size // 2
            self.draw.line((self.left, middle, self.right, middle), fill=self.ink, width=2)
            self.y += size
            return
        count = int((self.right - self.left) // _font(size).getlength(style))
        self.text(style * count, size, align="center")

    def gap(self, pixels: int) -> None:
        self.y += pixels

    def logo(self, style: str, name: str, size: int, align: str) -> bool:
        """Draw the shop's logo block; return whether it already shows the shop name."""
        font = _font(size)
        if style in ("inverted", "boxed"):
            box = (self.left, self.y, self.right, self.y + round(size * 2.2))
            if style == "inverted":
                self.draw.rectangle(box, fill=self.ink)
                colour = self.paper
            else:
                self.draw.rectangle(box, outline=self.ink, width=3)
                colour = self.ink
            centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
            self.draw.text(centre, name, font=font, fill=colour, anchor="mm", stroke_width=1)
            self.y = box[3] + size // 2
            return True
        if style == "circle":
            radius = size
            cx = self.left + radius if align == "left" else (self.left + self.right) / 2
            self.draw.ellipse((cx - radius, self.y, cx + radius, self.y + 2 * radius), outline=self.ink, width=3)
            initials = "".join(word[0] for word in name.split()[:2])
            self.draw.text((cx, self.y + radius), initials, font=font, fill=self.ink, anchor="mm")
            self.y += 2 * radius + size // 3
        elif style == "bars":
            width = self.right - self.left
            for fraction in (1.0, 0.7, 0.4):
                x0 = self.left + (1 - fraction) * width / 2
                self.draw.rectangle((x0, self.y, x0 + fraction * width, self.y + size // 3), fill=self.ink)
                self.y += size // 2
            self.y += size // 3
        return False

    def barcode(self, digits: str, height: int) -> None:
        """Bars whose widths follow the digits, so every receipt number gets its own code."""
        widths = [1 + (int(d) >> bit & 1) * 2 for d in digits for bit in range(3)]
        x = (self.left + self.right - (sum(widths) * 2 + 10)) / 2
        for i, w in enumerate([2, 1, *widths, 1, 2]):
            if i % 2 == 0:
                self.draw.rectangle((x, self.y, x + w - 1, self.y + height), fill=self.ink)
            x += w
        self.y += height + 4

    def tear_off(self) -> Image.Image:
        return self.image.crop((0, 0, self.image.width, self.y + self.margin))


def render_receipt(receipt: Receipt) -> Image.Image:
    """Render ``receipt`` as an upright RGB image of its paper, ``shop.paper_width`` wide."""
    shop = receipt.shop
    body = shop.body_size
    printer = _Printer(shop.paper_width, receipt.paper_rgb, receipt.ink)

    if not printer.logo(shop.logo, shop.name, shop.title_size, shop.header_align):
        printer.text(shop.name, shop.title_size, shop.header_align, bold=True)
    for line in (*shop.address, shop.contact):
        printer.text(line, body, shop.header_align)
    printer.separator(shop.separator, body)

    printer.text(_date_line(receipt), body)
    printer.text(receipt.number, body)
    printer.text(f"Cashier: {receipt.cashier}", body)
    printer.separator(shop.separator, body)

    _print_items(printer, receipt, body)
    printer.separator(shop.separator, body)

    printer.pair("SUBTOTAL", format_money(receipt.subtotal_cents), body)
    if shop.tax_rate:
        printer.pair(f"{shop.tax_label} {shop.tax_rate * 100:g}%", format_money(receipt.tax_cents), body)
    printer.pair("TOTAL", _total_text(receipt), body + 4, bold=True)
    printer.text(f"Items: {sum(item.quantity for item in receipt.items)}", body)
    printer.gap(body // 2)
    for label, value in receipt.payment:
        printer.pair(label, value, body)
    printer.separator(shop.separator, body)

    for line in shop.footer:
        printer.text(line, body, "center")
    if shop.barcode:
        printer.gap(body // 2)
        digits = "".join(ch for ch in receipt.number if ch.isdigit())
        printer.barcode(digits, height=3 * body)
        printer.text(digits, body - 2, "center")
    return printer.tear_off()


def _print_items(printer: _Printer, receipt: Receipt, size: int) -> None:
    style = receipt.shop.item_style
    if style == "columns":
        name_x = round(_font(size).getlength("QTY  "))
        printer.row(("QTY", "ITEM", "AMOUNT"), size, name_x)
        for item in receipt.items:
            printer.row((str(item.quantity), item.name, format_money(item.amount_cents)), size, name_x)
    elif style == "two_line":
        for item in receipt.items:
            printer.text(item.name, size)
            printer.pair(
                f"{item.quantity} @ {format_money(item.unit_cents)}", format_money(item.amount_cents), size, indent=size
            )
    else:
        for item in receipt.items:
            label = f"{item.quantity} x {item.name}" if item.quantity > 1 else item.name
            printer.pair(label, format_money(item.amount_cents), size)
