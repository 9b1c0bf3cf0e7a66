"""The hMLP stem as matmuls (model.HMLPStem) against its three convolutions, timed alternately in
one process.

    python experiments/speed/stem_ab.py [CONFIG] [THREADS]     # default: configs/demo.yaml, 1 thread

Two models from one seed, one with the convolutions' forward, each updated 25 times by
train.train_update on bench.synthetic_batch: the median update time of the last 22 of each, their
ratio and the largest loss difference.
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
import runtime  # noqa: E402
import schedules  # noqa: E402
import train  # noqa: E402
from config import load_config  # noqa: E402
from model import VJEPA3D  # noqa: E402


def convolutions(stem: nn.Sequential, volume: torch.Tensor) -> torch.Tensor:
    """The stem's layers as nn.Sequential runs them: Conv3d, GELU, Conv3d, GELU, Conv3d."""
    for layer in stem:
        volume = (
            layer._conv_forward(volume, layer.weight, layer.bias)
            if isinstance(layer, nn.Conv3d)
            else layer(volume)
        )
    return volume


def main() -> None:
    config = sys.argv[1] if len(sys.argv) > 1 else "configs/demo.yaml"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    cfg = load_config(["--config", config, "--device", "cpu", "--patch_stem", "hmlp"])
    rt = runtime.setup_runtime(cfg)
    arms = {}
    for name in ("convolutions", "matmuls"):
        torch.manual_seed(0)
        model = VJEPA3D.from_config(cfg)
        if name == "convolutions":
            for encoder in (model.encoder, model.target_encoder):
                encoder.patch_embed.forward = lambda volume, stem=encoder.patch_embed: convolutions(
                    stem, volume
                )
        arms[name] = {
            "model": model,
            "optimizer": train.make_optimizer(model, cfg, rt),
            "times": [],
            "losses": [],
        }
    batch = bench.synthetic_batch(cfg, cfg.per_core_batch_size)
    hp = schedules.Hyperparameters(cfg.base_lr, cfg.weight_decay, cfg.ema_base)
    for i in range(25):
        for arm in arms.values():
            start = time.perf_counter()
            result = train.train_update(arm["model"], arm["optimizer"], [batch], hp, cfg, rt)
            arm["times"] += [time.perf_counter() - start] if i >= 3 else []
            arm["losses"].append(float(result.loss))
    median = {name: sorted(arm["times"])[len(arm["times"]) // 2] for name, arm in arms.items()}
    for name, seconds in median.items():
        print(
            f"{name:13s} {seconds * 1000:.1f} ms an update (median of {len(arms[name]['times'])})"
        )
    print(f"ratio         {median['matmuls'] / median['convolutions']:.3f}")
    print(
        "losses        largest difference"
        f" {max(abs(a - b) for a, b in zip(*(a['losses'] for a in arms.values()))):.1e}"
    )


if __name__ == "__main__":
    main()
