"""Render benchmark results: a markdown report, PNG plots, and the README's results section."""

from __future__ import annotations

import os
import re
from typing import Any

README_BEGIN = "<!-- results:begin -->"
README_END = "<!-- results:end -->"


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        rows: list[tuple[str, Any]] = []
        for key, sub in value.items():
            rows += _flatten(sub, f"{prefix}.{key}" if prefix else str(key))
        return rows
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        rows = []
        for i, sub in enumerate(value):
            rows += _flatten(sub, f"{prefix}[{i}]")
        return rows
    return [(prefix, value)]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"Run on {m['date']}: {m['cpus']} CPUs ({m['processor']}), {m['platform']}, Python {m['python']}, "
             f"torch {m['torch']}{' (quick run)' if results.get('quick') else ''}.", ""]
    for name, outcome in results["benchmarks"].items():
        lines.append(f"### {name}")
        lines.append("")
        if not outcome["ok"]:
            lines += [f"Failed: `{outcome['error']}`", ""]
            continue
        lines += ["| measurement | value |", "| --- | --- |"]
        lines += [f"| {key} | {_fmt(val)} |" for key, val in _flatten(outcome["result"])]
        lines.append("")
    return "\n".join(lines)


def plots(results: dict, out_dir: str) -> list[str]:
    """Bar chart of the overhead step times; more plots where results have a known shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    overhead = results["benchmarks"].get("overhead")
    if overhead and overhead["ok"]:
        models = overhead["result"]["models"]
        fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
        for ax, (model, entry) in zip(axes[0], models.items()):
            modes = list(entry["step_ms"])
            ax.bar(modes, [entry["step_ms"][m] for m in modes], color="#4c72b0")
            ax.set_title(f"step time, {model}")
            ax.set_ylabel("ms per step (median)")
        fig.tight_layout()
        path = os.path.join(out_dir, "overhead.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def update_readme(markdown_text: str, readme_path: str) -> None:
    """Replace the text between the results markers (append the section if absent)."""
    text = open(readme_path).read() if os.path.exists(readme_path) else "# Benchmarks\n"
    block = f"{README_BEGIN}\n{markdown_text}\n{README_END}"
    if README_BEGIN in text and README_END in text:
        text = re.sub(re.escape(README_BEGIN) + ".*?" + re.escape(README_END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## Latest results\n\n" + block + "\n"
    with open(readme_path, "w") as fh:
        fh.write(text)
