"""Shop templates: the part of a receipt that every receipt from one shop shares.

Receipts from one shop look alike (header, logo, separators, column layout, footer), so
two of them are *hard negatives*: an embedding must tell them apart by their content
(items, totals, dates, numbers), not by the template. Each template is plain data; the
renderer interprets it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShopTemplate:
    """Layout and catalogue of one shop.

    ``item_style`` is one of ``"prefix"`` (``2 x Milk      3.98``), ``"columns"`` (a
    QTY / ITEM / AMOUNT table with a heading row) or ``"two_line"`` (name, then
    ``2 @ 1.99`` and the amount below it). ``logo`` is one of ``"inverted"``, ``"boxed"``,
    ``"circle"``, ``"bars"`` or ``"none"``. ``separator`` is a character repeated across
    the paper, or ``"rule"`` for a solid line. ``catalogue`` holds (name, low, high) unit
    prices in cents.
    """

    name: str
    address: tuple[str, ...]
    contact: str
    paper_width: int
    header_align: str
    logo: str
    separator: str
    item_style: str
    title_size: int
    body_size: int
    currency: str
    tax_label: str
    tax_rate: float
    date_format: str
    number_format: str
    footer: tuple[str, ...]
    barcode: bool
    catalogue: tuple[tuple[str, int, int], ...]


SHOPS: tuple[ShopTemplate, ...] = (
    ShopTemplate(
        name="GREENLEAF MARKET",
        address=("118 Harbour Road", "Port Ellis PE4 2QT"),
        contact="Tel 0161 555 0142",
        paper_width=384,
        header_align="center",
        logo="inverted",
        separator="-",
        item_style="prefix",
        title_size=24,
        body_size=16,
        currency="$",
        tax_label="TAX",
        tax_rate=0.07,
        date_format="%Y-%m-%d %H:%M",
        number_format="Receipt {a:04d}-{b:06d}",
        footer=("Thank you for shopping local!", "Keep this receipt for returns"),
        barcode=True,
        catalogue=(
            ("Whole Milk 1L", 119, 189),
            ("Free Range Eggs x12", 289, 419),
            ("Sourdough Loaf", 299, 449),
            ("Bananas", 79, 159),
            ("Cheddar 400g", 349, 529),
            ("Greek Yogurt", 159, 259),
            ("Tomatoes Vine", 189, 289),
            ("Olive Oil 500ml", 549, 899),
            ("Pasta Fusilli", 99, 179),
            ("Chicken Thighs", 499, 799),
            ("Apples Gala", 199, 329),
            ("Orange Juice", 229, 349),
            ("Butter Salted", 199, 299),
            ("Basmati Rice 1kg", 249, 399),
        ),
    ),
    ShopTemplate(
        name="Cafe Luna",
        address=("7 Vine Street",),
        contact="VAT GB 284 1193 07",
        paper_width=320,
        header_align="left",
        logo="circle",
        separator="=",
        item_style="two_line",
        title_size=26,
        body_size=15,
        currency="GBP",
        tax_label="VAT",
        tax_rate=0.2,
        date_format="%d/%m/%Y %H:%M",
        number_format="Order #{b:05d}  Till {a:02d}",
        footer=("Wifi: luna-guest",),
        barcode=False,
        catalogue=(
            ("Flat White", 280, 360),
            ("Cappuccino", 270, 350),
            ("Espresso", 190, 240),
            ("Chai Latte", 300, 380),
            ("Croissant", 210, 290),
            ("Almond Croissant", 290, 360),
            ("Banana Bread", 260, 330),
            ("Avocado Toast", 650, 850),
            ("Tomato Soup", 480, 590),
            ("Iced Tea", 250, 320),
            ("Brownie", 240, 300),
        ),
    ),
    ShopTemplate(
        name="BOLT & BEAM HARDWARE",
        address=("Unit 4, Millfield Trade Park", "Ashby AB12 9XR"),
        contact="www.boltandbeam.example",
        paper_width=448,
        header_align="center",
        logo="bars",
        separator="rule",
        item_style="columns",
        title_size=22,
        body_size=16,
        currency="$",
        tax_label="SALES TAX",
        tax_rate=0.0825,
        date_format="%m/%d/%Y %I:%M %p",
        number_format="INV {a:02d}{b:07d}",
        footer=("Returns within 30 days", "with receipt and packaging", "Trade accounts welcome"),
        barcode=True,
        catalogue=(
            ("Wood Screws 4x40 (200)", 599, 899),
            ("Claw Hammer 16oz", 1299, 1899),
            ("Masking Tape 25mm", 249, 399),
            ("Wall Plugs Red (100)", 199, 349),
            ("Sandpaper Assorted", 449, 699),
            ("Paint Roller 9in", 699, 1099),
            ("Silicone Sealant", 549, 849),
            ("Cable Ties (100)", 299, 499),
            ("Hex Key Set", 899, 1399),
            ("Extension Lead 4way", 1499, 2299),
            ("PVA Glue 1L", 499, 799),
            ("Tape Measure 5m", 699, 1199),
            ("LED Bulb E27", 349, 599),
        ),
    ),
    ShopTemplate(
        name="MERIDIAN PHARMACY",
        address=("22 Chapel Lane", "Westbury"),
        contact="Tel 020 7946 0018",
        paper_width=384,
        header_align="center",
        logo="boxed",
        separator="*",
        item_style="prefix",
        title_size=22,
        body_size=16,
        currency="EUR",
        tax_label="VAT",
        tax_rate=0.09,
        date_format="%d.%m.%Y %H:%M:%S",
        number_format="Bon {b:06d} / Kasse {a:d}",
        footer=("Get well soon", "Ask us about free health checks"),
        barcode=False,
        catalogue=(
            ("Paracetamol 500mg", 199, 349),
            ("Ibuprofen 200mg", 249, 399),
            ("Hand Cream", 399, 699),
            ("Vitamin D3", 599, 999),
            ("Plasters Assorted", 299, 499),
            ("Throat Lozenges", 349, 549),
            ("Sun Cream SPF50", 899, 1499),
            ("Toothpaste", 199, 349),
            ("Saline Spray", 499, 799),
            ("Cotton Pads", 149, 249),
            ("Allergy Tablets", 399, 699),
        ),
    ),
    ShopTemplate(
        name="NORTHSIDE FUEL",
        address=("A34 Northbound", "Site 0417"),
        contact="Open 24 hours",
        paper_width=352,
        header_align="left",
        logo="none",
        separator=".",
        item_style="columns",
        title_size=24,
        body_size=15,
        currency="$",
        tax_label="TAX",
        tax_rate=0.05,
        date_format="%Y/%m/%d %H:%M:%S",
        number_format="TRANS {b:06d} PUMP {a:02d}",
        footer=("Drive safely",),
        barcode=True,
        catalogue=(
            ("Unleaded Fuel", 2500, 7500),
            ("Diesel", 3000, 8500),
            ("Screenwash 5L", 499, 799),
            ("Coffee To Go", 179, 249),
            ("Sandwich", 299, 449),
            ("Energy Drink", 149, 229),
            ("Chocolate Bar", 89, 149),
            ("Car Wash Token", 500, 900),
            ("Water 500ml", 99, 159),
            ("Crisps", 89, 139),
        ),
    ),
    ShopTemplate(
        name="Page Turner Books",
        address=("3 Market Square", "Oldbridge OB1 1AA"),
        contact="pageturner.example",
        paper_width=384,
        header_align="center",
        logo="boxed",
        separator="~",
        item_style="two_line",
        title_size=24,
        body_size=16,
        currency="$",
        tax_label="TAX",
        tax_rate=0.0,
        date_format="%b %d %Y  %H:%M",
        number_format="Sale {b:05d}-{a:03d}",
        footer=("Books make great gifts", "Exchange within 14 days"),
        barcode=True,
        catalogue=(
            ("The Quiet Harbour", 899, 1499),
            ("Atlas of Small Islands", 1999, 2999),
            ("Cooking With Beans", 1299, 1899),
            ("Night Trains", 799, 1199),
            ("A Field Guide to Moss", 1499, 2199),
            ("Poems for Tuesdays", 699, 999),
            ("Greeting Card", 199, 349),
            ("Bookmark Leather", 299, 499),
            ("The Lighthouse Keeper", 899, 1399),
            ("Puzzle Book", 499, 799),
        ),
    ),
    ShopTemplate(
        name="TRATTORIA VERDE",
        address=("41 Canal Walk", "Riverside"),
        contact="Bookings 0117 496 0733",
        paper_width=416,
        header_align="center",
        logo="circle",
        separator="=",
        item_style="prefix",
        title_size=26,
        body_size=17,
        currency="EUR",
        tax_label="IVA",
        tax_rate=0.1,
        date_format="%d-%m-%Y %H:%M",
        number_format="Table {a:02d}  Check {b:05d}",
        footer=("Grazie e arrivederci!", "Service not included"),
        barcode=False,
        catalogue=(
            ("Bruschetta", 550, 750),
            ("Margherita", 900, 1150),
            ("Tagliatelle Ragu", 1250, 1550),
            ("Risotto Funghi", 1300, 1650),
            ("Tiramisu", 600, 750),
            ("House Red 250ml", 650, 850),
            ("Sparkling Water", 300, 400),
            ("Espresso", 200, 280),
            ("Insalata Mista", 500, 700),
            ("Calzone", 1050, 1300),
            ("Panna Cotta", 550, 700),
        ),
    ),
    ShopTemplate(
        name="QUICKSTOP 24",
        address=("Station Parade",),
        contact="Store 1187",
        paper_width=336,
        header_align="left",
        logo="inverted",
        separator="-",
        item_style="columns",
        title_size=22,
        body_size=15,
        currency="$",
        tax_label="GST",
        tax_rate=0.1,
        date_format="%d %b %Y %H:%M",
        number_format="Txn {b:07d} Reg {a:d}",
        footer=("Open all hours",),
        barcode=True,
        catalogue=(
            ("Cola 330ml", 99, 149),
            ("Bread White", 119, 189),
            ("Milk 2L", 189, 259),
            ("Newspaper", 150, 250),
            ("Batteries AA x4", 349, 549),
            ("Chewing Gum", 79, 119),
            ("Instant Noodles", 89, 149),
            ("Ice Cream Tub", 349, 499),
            ("Phone Top-up", 1000, 2000),
            ("Crisps Salted", 89, 139),
            ("Frozen Pizza", 299, 449),
        ),
    ),
)
