"""Draws docs/images/architecture.png, the README's picture of the four services and a request's path.

    .venv/bin/python scripts/architecture_diagram.py   # rewrites the image; commit both

Drawn with matplotlib (a dependency already) so that the picture is text in the repository, reviewed and changed
like code; the names and ports are the services' own (docs/settings.md, "Ports").
"""

from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "images" / "architecture.png"

# colours: the request path warm, the catalogue's path grey
GATEWAY, MODEL, STORE, OUTSIDE = "#fde2c8", "#d7e8fb", "#e4e4e4", "#ffffff"
REQUEST, CATALOGUE = "#c0502a", "#6b6b6b"


def draw(out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(11, 6.2))
    ax.set_xlim(0, 14)
    ax.set_ylim(-0.5, 7.4)
    ax.axis("off")

    def box(x, y, w, h, title, body, colour, dashed=False):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15", fc=colour,
                                    ec="#333333", lw=1.2, ls="--" if dashed else "-"))
        ax.text(x + w / 2, y + h - 0.3, title, ha="center", va="top", fontsize=11.5, weight="bold")
        ax.text(x + w / 2, y + h - 0.75, body, ha="center", va="top", fontsize=8.6, linespacing=1.35)

    def arrow(a, b, colour, text="", at=(0.0, 0.0), dashed=False, both=False, rad=0.0):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="<|-|>" if both else "-|>", mutation_scale=13, lw=1.5,
                                     color=colour, ls="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}"))
        if text:
            ax.text(*at, text, ha="center", va="center", fontsize=8.6, color=colour)

    box(0.2, 3.35, 2.5, 1.7, "your backend", "a gRPC client\n(or specrec recommend)", OUTSIDE, dashed=True)
    box(4.1, 3.05, 3.9, 2.3, "gateway  :50050",
        "validate → admit → serve → respond\nthe policy's draft/verify loop\n"
        "budget clock (30 ms), auto, fallbacks", GATEWAY)
    box(9.9, 5.5, 3.9, 1.75, "drafter  :50052", "cheap candidates: SASRec,\nretrieval, self-drafter", MODEL)
    box(9.9, 3.05, 3.9, 2.1, "verifier  :50053",
        "the generative model (TIGER-style,\nsemantic IDs) checks the drafts\nin one pass; ONNX Runtime / CUDA", MODEL)
    box(4.1, 0.2, 3.9, 1.75, "item set  :50051", "valid semantic IDs, catalogue\nversions, upserts (write token)",
        STORE)
    box(9.9, 0.2, 3.9, 1.75, "Redis", "the catalogue's versions\n(one server, or Sentinel)", STORE)

    # a request's path
    arrow((2.75, 4.65), (4.05, 4.65), REQUEST, "① Recommend\nhistory, k, policy,\nbudget_ms", at=(3.4, 5.45))
    arrow((8.05, 5.05), (9.85, 6.05), REQUEST, "② Draft", at=(8.55, 5.85))
    arrow((8.05, 4.35), (9.85, 4.35), REQUEST, "③ Search / Score", at=(8.95, 4.6))
    arrow((4.05, 3.65), (2.75, 3.65), REQUEST, "④ top-K items,\nscores, stats", at=(3.4, 2.9))
    # the catalogue's path, off the request path
    arrow((8.05, 1.05), (9.85, 1.05), CATALOGUE, both=True)
    arrow((6.05, 2.0), (6.05, 3.0), CATALOGUE, dashed=True)
    arrow((8.05, 1.75), (10.5, 3.0), CATALOGUE, dashed=True)
    arrow((8.05, 1.95), (9.85, 5.75), CATALOGUE, dashed=True, rad=0.3)
    ax.text(0.2, 1.05, "catalogue writers:\nUpsert, Delete,\nRollback", ha="left", va="center", fontsize=8.6,
            color=CATALOGUE)
    arrow((2.4, 1.05), (4.05, 1.05), CATALOGUE)
    ax.text(7.0, -0.25, "①-④ a request's path.   - - -  the catalogue's versions, polled by the gateway, the drafter "
            "and the verifier (not on the request path)", ha="center", va="center", fontsize=8.6, color=CATALOGUE,
            style="italic")

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(draw())
