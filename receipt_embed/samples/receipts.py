"""Receipt content: what differs between two receipts from the same shop.

Items, quantities, prices, totals, tax, date and time, receipt number, cashier and payment
are drawn per receipt from a generator seeded by ``(seed, index)``, so a receipt is fully
determined by those two numbers and the shop templates. Amounts are integer cents, so
totals add up exactly as printed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import numpy as np

from receipt_embed.samples.shops import SHOPS, ShopTemplate

# Keys that keep the random streams of one seed apart.
_SHOP_ORDER_STREAM = 0
_CONTENT_STREAM = 1

_CASHIERS = ("Sam", "Priya", "Tom", "Ana", "Lee", "Jo", "Marta", "Dev", "Kim", "Olu")
_CARDS = ("VISA", "MASTERCARD", "AMEX", "DEBIT")
_QUANTITIES = (1, 1, 1, 1, 1, 2, 2, 3, 4)
_FIRST_DAY = datetime(2023, 1, 1)


@dataclass(frozen=True)
class LineItem:
    """One purchased line: a catalogue item bought ``quantity`` times."""

    name: str
    quantity: int
    unit_cents: int

    @property
    def amount_cents(self) -> int:
        return self.quantity * self.unit_cents


@dataclass(frozen=True)
class Receipt:
    """Everything printed on one receipt, plus the paper and ink it is printed with."""

    receipt_id: str
    shop: ShopTemplate
    issued: datetime
    number: str
    cashier: str
    items: tuple[LineItem, ...]
    payment: tuple[tuple[str, str], ...]
    paper_rgb: tuple[int, int, int]
    ink: int

    @property
    def subtotal_cents(self) -> int:
        return sum(item.amount_cents for item in self.items)

    @property
    def tax_cents(self) -> int:
        return round(self.subtotal_cents * self.shop.tax_rate)

    @property
    def total_cents(self) -> int:
        return self.subtotal_cents + self.tax_cents


def format_money(cents: int) -> str:
    """``1234`` -> ``"12.34"``."""
    return f"{cents // 100}.{cents % 100:02d}"


def shop_for(seed: int, index: int, shops: tuple[ShopTemplate, ...] = SHOPS) -> ShopTemplate:
    """The shop of receipt ``index``: shops take turns in a seed-dependent order.

    Taking turns keeps the shops balanced, so even a small set has several receipts per
    shop (hard negatives) and every shop appears.
    """
    order = np.random.default_rng([seed, _SHOP_ORDER_STREAM]).permutation(len(shops))
    return shops[int(order[index % len(shops)])]


def make_receipt(seed: int, index: int, shops: tuple[ShopTemplate, ...] = SHOPS) -> Receipt:
    """Draw the content of receipt ``index`` of the set generated with ``seed``."""
    shop = shop_for(seed, index, shops)
    rng = np.random.default_rng([seed, _CONTENT_STREAM, index])

    n_items = int(rng.integers(2, min(12, len(shop.catalogue)) + 1))
    picks = rng.choice(len(shop.catalogue), size=n_items, replace=False)
    items = tuple(
        LineItem(
            name=shop.catalogue[int(i)][0],
            quantity=int(rng.choice(_QUANTITIES)),
            unit_cents=int(rng.integers(shop.catalogue[int(i)][1], shop.catalogue[int(i)][2] + 1)),
        )
        for i in picks
    )

    issued = _FIRST_DAY + timedelta(
        days=int(rng.integers(0, 730)),
        minutes=int(rng.integers(7 * 60, 22 * 60)),
        seconds=int(rng.integers(0, 60)),
    )
    number = shop.number_format.format(a=int(rng.integers(1, 100)), b=int(rng.integers(0, 100_000)))
    cashier = str(rng.choice(_CASHIERS))

    receipt = Receipt(
        receipt_id=f"r{index:04d}",
        shop=shop,
        issued=issued,
        number=number,
        cashier=cashier,
        items=items,
        payment=(),
        paper_rgb=_paper_rgb(rng),
        ink=int(rng.integers(15, 70)),
    )
    return replace(receipt, payment=_payment(receipt.total_cents, rng))


def _paper_rgb(rng: np.random.Generator) -> tuple[int, int, int]:
    """White to slightly cream thermal paper: one brightness, a little less blue when warm."""
    level = int(rng.integers(240, 253))
    warmth = int(rng.integers(0, 9))
    return (min(255, level + 2), level, level - warmth)


def _payment(total: int, rng: np.random.Generator) -> tuple[tuple[str, str], ...]:
    """A card payment, or cash: the next note up (or whole units) tendered, change given."""
    if rng.random() < 0.6:
        return (
            (f"{rng.choice(_CARDS)} **** {int(rng.integers(0, 10_000)):04d}", format_money(total)),
            (f"AUTH {int(rng.integers(0, 1_000_000)):06d}", "APPROVED"),
        )
    notes = [note for note in (500, 1000, 2000, 5000, 10_000) if note >= total]
    whole_units = -(-total // 100) * 100
    tendered = int(rng.choice(notes[:1] + [whole_units]))
    return (("CASH", format_money(tendered)), ("CHANGE", format_money(tendered - total)))
