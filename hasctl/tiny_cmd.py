"""`hasctl make-tiny`: write a random-weight checkpoint of a supported family."""
from __future__ import annotations

from easerve.models.tiny import LAYOUTS, make_layout
from easerve.models.tiny.build import BUILDERS


def add_parser(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint folder")
    p.add_argument("--family", required=True, choices=sorted(BUILDERS))
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", default="tiny", choices=["tiny", "bench"],
                   help="tiny: a few MB for tests; bench: tens of millions of parameters")
    p.add_argument("--layout", default="default", choices=LAYOUTS,
                   help="default: as transformers 5 saves it; published: the hub repos' weight names, config "
                        "fields and shards (llava-hf, Qwen, fixie-ai Ultravox with audio/text model folders)")
    p.set_defaults(func=run)


def run(args) -> int:
    out = make_layout(args.family, args.out, seed=args.seed, scale=args.scale, layout=args.layout)
    print(f"wrote {args.family} ({args.scale}, seed {args.seed}, {args.layout} layout) to {out}")
    return 0
