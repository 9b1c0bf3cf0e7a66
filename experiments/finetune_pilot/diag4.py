import sys, time, copy, numpy as np, torch
sys.path.insert(0, "/work/wt/issue24")
import finetune, probe
from model import load_encoder
E = "/work/wt/issue24-exp"
enc = load_encoder(f"{E}/enc-s0")
cfg = enc.settings
data = finetune.load_labelled_set(f"{E}/data/phantoms_learn_probe/labels.csv", cfg)
(tr, te) = finetune.patient_folds(data, 5, 0)[1]
fit, val = finetune.validation_split(data, tr, 0.2, 1)
head_mult = float(sys.argv[4])
orig_groups = finetune.layer_decay_groups
def groups(model, settings):
    gs = orig_groups(model, settings)
    head_ids = {id(p) for p in model.head.parameters()}
    out = []
    for g in gs:
        h = [p for p in g["params"] if id(p) in head_ids]
        o = [p for p in g["params"] if id(p) not in head_ids]
        if o: out.append({**g, "params": o})
        if h: out.append({**g, "params": h, "lr_scale": g["lr_scale"] * head_mult})
    return out
finetune.layer_decay_groups = groups
for lr in map(float, sys.argv[1].split(",")):
    s = finetune.FullSettings(epochs=int(sys.argv[2]), lr=lr, patience=100, layer_decay=float(sys.argv[3]))
    t = time.time()
    model, log = finetune.finetune_fold(enc, data, fit, val, cfg, s, 1, "cpu")
    probs, _ = finetune.predict(model, data, te, cfg, 8, "cpu")
    print("headx", head_mult, lr, finetune.task_scores(probs, data.targets[te], data.task), "best", log["best_epoch"], f"{time.time()-t:.0f}s", flush=True)
    print("  ", [(h["epoch"], round(h["train_loss"], 3), round(h["val_loss"], 3)) for h in log["history"]], flush=True)
