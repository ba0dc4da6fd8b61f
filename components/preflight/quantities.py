"""Kubernetes resource quantities ("500m", "512Gi", "1e3") as numbers, and back for people: the nodes, memory and
checkpoint checks all compare amounts the API server writes in this notation."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

GI = Decimal(2**30)

_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?")
_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity as a number: "96", "500m", "512Gi", "2063937952Ki", "1e3", "1.5", 8."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.fullmatch(value.strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None
    if not suffix:
        return amount
    if suffix[0] in "eE" and len(suffix) > 1:
        return amount.scaleb(int(suffix[1:]))
    return amount * Decimal(_SUFFIX[suffix])


def show(resource: str, amount: Decimal) -> str:
    """A quantity for people: memory in Gi, everything else as a plain number."""
    if resource == "memory" or resource.endswith("storage"):
        gib = amount / GI
        return f"{gib.quantize(Decimal(1)) if gib == gib.to_integral_value() else round(gib, 1)}Gi"
    return str(amount.quantize(Decimal(1)) if amount == amount.to_integral_value() else amount.normalize())
