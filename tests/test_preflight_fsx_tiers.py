"""The FSx for Lustre sizes the checkpoint-throughput check names in its fix, as the FSx CSI driver provisions
them."""

from __future__ import annotations

from decimal import Decimal

import pytest

from components.preflight.fsx_tiers import fsx_size_gib


@pytest.mark.parametrize(
    ("request_gib", "deployment", "storage_type", "per_unit", "size"),
    [
        (1, "SCRATCH_2", "SSD", 100, 1200),
        (1201, "SCRATCH_2", "SSD", 100, 2400),
        (2401, "SCRATCH_2", "SSD", 100, 4800),
        (2401, "PERSISTENT_2", "SSD", 125, 4800),
        (3000, "SCRATCH_1", "SSD", 200, 3600),
        (3601, "SCRATCH_1", "SSD", 200, 7200),
        (2401, "SCRATCH_1", "SSD", 200, 3600),
        (100, "PERSISTENT_1", "HDD", 12, 6000),
        (6001, "PERSISTENT_1", "HDD", 12, 12000),
        (1801, "PERSISTENT_1", "HDD", 40, 3600),
    ],
)
def test_sizes_round_up_as_the_fsx_csi_driver_provisions_them(
    request_gib: int, deployment: str, storage_type: str, per_unit: int, size: int
) -> None:
    assert fsx_size_gib(Decimal(request_gib), deployment, storage_type, per_unit) == size
