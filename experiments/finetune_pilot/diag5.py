import sys, time, numpy as np, torch, torch.nn.functional as F
sys.path.insert(0, "/work/wt/issue24")
import finetune, probe
from model import load_encoder
E = "/work/wt/issue24-exp"
enc = load_encoder(f"{E}/enc-s0")
cfg = enc.settings
data = finetune.load_labelled_set(f"{E}/data/phantoms_learn_probe/labels.csv", cfg)
(tr, te) = finetune.patient_folds(data, 5, 0)[1]
fit, val = finetune.validation_split(data, tr, 0.2, 1)
tokens = probe.encode_volumes(enc, finetune.model_inputs(data, range(len(data.paths)), cfg), "cpu")
y = torch.from_numpy(data.targets).long()
for lr in (1e-3, 3e-3):
  for bs in (32, 64):
    torch.manual_seed(0); rng = np.random.default_rng(0)
    head = probe.AttentiveProbe(96, 3)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-2)
    for step in range(300):
        b = rng.choice(fit, bs, replace=False) if bs < len(fit) else fit
        loss = F.cross_entropy(head(tokens[b]), y[b]); opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        trl = float(F.cross_entropy(head(tokens[fit]), y[fit])); tel = float(F.cross_entropy(head(tokens[te]), y[te]))
    print(lr, bs, "train loss", round(trl,3), "test loss", round(tel,3), probe.attentive_scores(head, tokens[te], data.targets[te]), flush=True)
