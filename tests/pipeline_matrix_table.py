"""Print the README's "Supported pipelines" table (family x mode) from the matrix.

Runs every cell of ``diffusion_offload.testing.pipeline_matrix`` on the fake device (about a
minute on two cores) and prints a Markdown table: ``exact`` (bit-equal to all-resident,
``audit() == []``, no weight D2H, every selected component moved), ``refused`` (the
documented refusal ``enable()`` raises; the reasons follow the table) or ``FAILS``.

Usage: ``HF_HUB_OFFLINE=1 python tests/pipeline_matrix_table.py``
"""

from __future__ import annotations

from diffusion_offload.testing import fake_accelerator
from diffusion_offload.testing.pipeline_matrix import FAMILIES, MODES, check, reference


def main() -> None:
    """Run the matrix and print the table and the refusals."""
    device = fake_accelerator.install()
    lines = ["| family | pipeline class | " + " | ".join(MODES) + " |", "|---|---|" + "---|" * len(MODES)]
    reasons: list[str] = []
    for key, fam in FAMILIES.items():
        ref = reference(key, device)
        row = []
        for mode in MODES:
            cell = check(key, mode, device, ref)
            if cell.refused is not None:
                row.append("refused")
                reasons.append(f"* {fam.label}, {mode}: {cell.refused.splitlines()[0][:160]}")
            else:
                row.append("exact" if cell.passed else "FAILS")
        lines.append(f"| {fam.label} | `{fam.pipeline}` | " + " | ".join(row) + " |")
    print("\n".join(lines))
    print()
    print("Modes: " + "; ".join(f"`{k}`: {v}" for k, v in MODES.items()) + ".")
    if reasons:
        print()
        print("Refusals:")
        print("\n".join(reasons))


if __name__ == "__main__":
    main()
