"""In-training curves of the experiment runs (experiments/runs/NAME/metrics.jsonl) -> experiments/curves.json:
probe AUROC (mean-pool, fixed split), val loss, val RankMe and val target_std per logged update."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    curves = {}
    for name in sys.argv[1:]:
        with open(os.path.join(HERE, "runs", name, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        curves[name] = {"probe_auroc": [[r["step"], round(r["probe_auroc"], 3)] for r in records if r["split"] == "probe"],
                        **{f"val_{k}": [[r["step"], round(r[k], 4)] for r in records if r["split"] == "val"]
                           for k in ("loss", "rankme", "target_std")}}
    with open(os.path.join(HERE, "curves.json"), "w") as f:
        json.dump(curves, f, indent=1)
