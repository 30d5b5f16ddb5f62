"""`hasctl make-tiny`: write a random-weight checkpoint of a supported family."""
from __future__ import annotations

from easerve.models.tiny import BUILDERS, make_tiny


def add_parser(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint folder")
    p.add_argument("--family", required=True, choices=sorted(BUILDERS))
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", default="tiny", choices=["tiny", "bench"],
                   help="tiny: a few MB for tests; bench: tens of millions of parameters")
    p.set_defaults(func=run)


def run(args) -> int:
    out = make_tiny(args.family, args.out, seed=args.seed, scale=args.scale)
    print(f"wrote {args.family} ({args.scale}, seed {args.seed}) to {out}")
    return 0
