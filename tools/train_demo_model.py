"""Trains the built-in demo model: DeepSeek-V3 architecture (MLA, dense first layer, MoE with the V3 router,
one MTP layer), the real DeepSeek-V3 tokenizer (vocabulary 129,280), on the text of tools/prepare_demo_data.py.
One call does everything, time-boxed by the wall clock:

  PYTHONUNBUFFERED=1 python3 tools/train_demo_model.py --data .train --out $OUT --minutes 7
  /usr/bin/python3 tools/train_demo_model.py --data .train --out /tmp/smoke --smoke     (CPU, ~1 minute)

Training (see tools/README.md for the why):
  - compact vocabulary: only the token ids that occur in the data (.train/kept.json) have embedding and head
    rows; every other row is exactly 0 (embedding: the zero vector; logit: exactly 0). The loss is the exact
    full-vocabulary cross entropy: the zero rows enter the softmax as one extra logit log(#zero rows).
  - loss = CE(main, t_{i+1}) + 0.3 * CE(MTP, t_{i+2}) (DeepSeek-V3 §2.2, lambda = 0.3).
  - router: aux-loss-free balancing (DeepSeek-V3 §2.1.2): after each step e_score_correction_bias +=
    gamma * sign(mean load - load of the expert), gamma = 1e-3; no auxiliary loss.
  - AdamW (fused on CUDA), bf16 autocast, lr warmup then cosine decay over the wall-clock budget; the weights
    with the best validation loss (checked every --eval-every seconds) are the ones exported.
Then, within ~1.5 minutes: export, evaluation, reference logits. Writes to --out:
  demo-model.xz.NN       the checkpoint, packed (tools/unpack_demo_model.py turns it into models/demo and
                         models/demo-fp8), split into parts <= 15 MiB
  config.json            the model's config.json
  metrics.json           losses, perplexity, accuracies, MTP acceptance, tokens, throughput, wall times
  demo-reference.safetensors  float64 PyTorch logits (stored float32) of fixed prompts from the exported
                         bf16 weights, for tests/unit/demo_model_test.cpp
  train.log              the log
If interrupted (SIGINT/SIGTERM) it stops training and still exports.
"""
import argparse
import copy
import json
import lzma
import math
import os
import signal
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_model  # noqa: E402
import safetensors_io  # noqa: E402

T_START = time.time()

DEMO_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 160, "intermediate_size": 640, "moe_intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 16,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 32,
    "v_head_dim": 64, "qk_nope_head_dim": 32, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "hidden_act": "silu", "max_position_embeddings": 2048, "rope_theta": 10000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "chat_format": "deepseek-v4.1",  # DeepInfer's key: the format the data was rendered in (the server's default)
}
SMOKE_CONFIG = dict(DEMO_CONFIG, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)
MTP_LAMBDA = 0.3
BIAS_UPDATE_SPEED = 1e-3
EOS = 1
PART_BYTES = 15 << 20


def log(*args):
    line = "[%7.1fs] %s" % (time.time() - T_START, " ".join(str(a) for a in args))
    print(line, flush=True)
    LOG_LINES.append(line)


LOG_LINES = []
STOP = {"now": False}


def on_signal(signum, frame):
    STOP["now"] = True
    log("signal %d: stopping training, exporting" % signum)


def load_stream(path):
    return np.frombuffer(lzma.decompress(open(path, "rb").read()), dtype="<u2").astype(np.int64)


def init_weights(model, config):
    std = 0.02
    out_std = std / math.sqrt(2 * (config["num_hidden_layers"] + 1))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("shared_head_norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, 0.0, out_std)
        else:
            torch.nn.init.normal_(p, 0.0, std)


def moe_layers(model):
    return [l.mlp for l in list(model.layers) + list(model.mtp) if isinstance(l.mlp, demo_model.Moe)]


def windows(stream, starts, length):
    idx = starts[:, None] + torch.arange(length, device=stream.device)[None]
    return stream[idx]


def losses(model, batch, T):
    """batch [B, T + 2] compact ids -> (main CE, MTP CE, hidden, main logits, mtp logits)."""
    inputs, targets = batch[:, :T], batch[:, 1: T + 1]
    h = model.hidden(inputs)
    logits = model.lm_head(h)
    main = model.cross_entropy(logits, targets)
    mtp_h = model.mtp_hidden(h, batch[:, 1: T + 1])
    mtp_logits = model.lm_head(mtp_h)
    mtp = model.cross_entropy(mtp_logits, batch[:, 2: T + 2])
    return main, mtp, logits, mtp_logits


def full_argmax(logits):
    """Argmax over the full vocabulary in compact terms: -1 when a zero row (logit 0) beats every kept row."""
    best, index = logits.max(-1)
    return torch.where(best >= 0, index, torch.full_like(index, -1))


@torch.no_grad()
def evaluate(model, stream, T, batch_size, max_tokens, device, autocast):
    """Mean main/MTP CE, main top-1 accuracy, teacher-forced MTP accuracy on consecutive windows."""
    n = stream.numel()
    count = max(1, min(max_tokens // T, (n - 2) // T))
    starts = torch.arange(count, device=device) * T
    tot = {"main": 0.0, "mtp": 0.0, "main_acc": 0.0, "mtp_acc": 0.0}
    for i in range(0, count, batch_size):
        batch = windows(stream, starts[i: i + batch_size], T + 2)
        with autocast():
            main, mtp, logits, mtp_logits = losses(model, batch, T)
        rows = batch.shape[0]
        tot["main"] += main.item() * rows
        tot["mtp"] += mtp.item() * rows
        tot["main_acc"] += (full_argmax(logits.float()) == batch[:, 1: T + 1]).float().mean().item() * rows
        tot["mtp_acc"] += (full_argmax(mtp_logits.float()) == batch[:, 2: T + 2]).float().mean().item() * rows
    return {k: v / count for k, v in tot.items()} | {"tokens": count * T}


@torch.no_grad()
def generate_and_accept(model, prompts, max_new, device):
    """Greedy generation (float32) from held-out chat prompts, then the MTP draft acceptance on the generated
    text: at each position i with t_{i+1}, t_{i+2} both generated, draft = argmax MTP(h_i, t_{i+1}) vs t_{i+2}."""
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    lengths = [len(p) for p in prompts]
    for _ in range(max_new):
        active = [i for i, d in enumerate(done) if not d]
        if not active:
            break
        L = max(len(seqs[i]) for i in active)
        ids = torch.zeros(len(active), L, dtype=torch.long, device=device)
        for row, i in enumerate(active):  # right-aligned: the last real token is at column L - 1
            ids[row, L - len(seqs[i]):] = torch.tensor(seqs[i], device=device)
        pad = torch.tensor([L - len(seqs[i]) for i in active], device=device)
        h = model.hidden(ids, pad=pad)
        nxt = full_argmax(model.lm_head(h[:, -1]).float())
        for row, i in enumerate(active):
            token = int(nxt[row])
            seqs[i].append(token)
            if token == model.eos_compact or token < 0 or len(seqs[i]) - lengths[i] >= max_new:
                done[i] = True
    accepted = total = 0
    generated_tokens = 0
    for seq, plen in zip(seqs, lengths):
        generated_tokens += len(seq) - plen
        if -1 in seq:  # a never-seen token was the greedy choice: it has no compact id; stop there
            seq = seq[: seq.index(-1)]
        ids = torch.tensor(seq, device=device)[None]
        h = model.hidden(ids)
        L = ids.shape[1]
        if L - plen < 2:
            continue
        draft = full_argmax(model.lm_head(model.mtp_hidden(h[:, : L - 1], ids[:, 1:L])).float())[0]
        # draft[i] predicts seq[i + 2]; positions i = plen - 1 .. L - 3
        i = torch.arange(plen - 1, L - 2, device=device)
        accepted += int((draft[i] == ids[0, i + 2]).sum())
        total += int(i.numel())
    ended = sum(1 for s in seqs if s and s[-1] == model.eos_compact)
    return {"mtp_acceptance_greedy": accepted / max(total, 1), "positions": total, "prompts": len(prompts),
            "generated_tokens": generated_tokens, "ended_with_eos": ended}, seqs


def pack_artifact(model, config, out_dir, kept, with_fp8=True):
    """Exports bf16 (e_score_correction_bias float32) + the FP8 block-scaled copy of the linear layers, as one
    safetensors container whose BF16 payloads are split into byte planes (high bytes then low bytes: the
    exponents compress far better alone), xz-compressed and cut into parts. -> (files, bf16 tensors dict)."""
    state = model.export_state()
    tensors, bf16 = {}, {}
    for name, t in state.items():
        t = t.detach().float().cpu()
        if name.endswith("e_score_correction_bias"):
            tensors[name] = ("F32", list(t.shape), t.numpy().astype("<f4").tobytes())
            bf16[name] = t.clone()
            continue
        raw = safetensors_io.f32_to_bf16(t.numpy())
        bf16[name] = torch.from_numpy(safetensors_io.bf16_to_f32(raw).copy())
        planes = np.concatenate([(raw >> 8).astype(np.uint8).ravel(), (raw & 0xFF).astype(np.uint8).ravel()])
        tensors[name] = ("BF16", list(t.shape), planes.tobytes())
    if with_fp8:
        for name, fp8, scale in fp8_tensors(bf16, config):
            tensors["fp8." + name] = ("F8_E4M3", list(fp8.shape), fp8.tobytes())
            tensors["fp8." + name + "_scale_inv"] = ("F32", list(scale.shape), scale.astype("<f4").tobytes())
    container = os.path.join(out_dir, "demo-model.container")
    safetensors_io.write(container, tensors, {"layout": "bf16-byte-planes", "kept_rows": str(len(kept))})
    data = open(container, "rb").read()
    os.remove(container)
    t0 = time.time()
    packed = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9)
    log("packed %.1f MB -> %.1f MB in %.1fs" % (len(data) / 1e6, len(packed) / 1e6, time.time() - t0))
    files = []
    for part in range(0, len(packed), PART_BYTES):
        path = os.path.join(out_dir, "demo-model.xz.%02d" % (part // PART_BYTES))
        open(path, "wb").write(packed[part: part + PART_BYTES])
        files.append(path)
    return files, bf16, len(packed)


FP8_MAX = 448.0


def fp8_tensors(bf16, config):
    """DeepSeek's block-scaled FP8 (inference/kernel.py weight_quant's convention): per 128x128 block,
    scale_inv = amax / 448, weight_fp8 = e4m3(w / scale_inv), round to nearest even, as torch's cast. For
    the tensors our loader marks fp8_quantizable (the linear layers; not embeddings, head, norms or router)."""
    out = []
    for name in sorted(bf16):
        w = bf16[name]
        if w.dim() != 2 or not name.endswith("_proj.weight") or name.endswith("eh_proj.weight"):
            continue
        rows, cols = w.shape
        br, bc = (rows + 127) // 128, (cols + 127) // 128
        padded = torch.zeros(br * 128, bc * 128)
        padded[:rows, :cols] = w
        blocks = padded.view(br, 128, bc, 128)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = (amax / FP8_MAX).float()
        q = (blocks / scale[:, None, :, None]).view(br * 128, bc * 128)[:rows, :cols]
        out.append((name, to_e4m3(q.contiguous()), scale.numpy()))
    return out


def to_e4m3(x):
    if hasattr(torch, "float8_e4m3fn"):
        return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    # torch 1.13: nearest-even onto the e4m3 grid through a table of all 127 non-negative finite codes.
    codes = np.arange(127, dtype=np.uint8)
    values = torch.from_numpy(safetensors_io.e4m3_to_f32(codes)).double()
    a = x.abs().double().clamp(max=FP8_MAX)
    hi = torch.searchsorted(values, a.contiguous()).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - values[lo], values[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo).to(torch.uint8).numpy()
    return code | np.where(x.numpy() < 0, 0x80, 0).astype(np.uint8)


@torch.no_grad()
def reference_logits(bf16, config, prompts, out_path, greedy_tokens=16):
    """Full-vocabulary logits in float64 from the exported (bf16-rounded) weights, at the last prompt position,
    and 16 greedy tokens: the engine's float32 path must match (tests/unit/demo_model_test.cpp)."""
    model = demo_model.DeepSeekV3(config).double().eval()
    model.load_checkpoint_state({k: v.double() for k, v in bf16.items()})
    for moe in moe_layers(model):
        moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.double()
    tensors = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(prompt)[None]
        logits = model.lm_head(model.hidden(ids))[0]
        greedy = []
        seq = list(prompt)
        nxt = int(logits[-1].argmax())
        for _ in range(greedy_tokens):
            greedy.append(nxt)
            seq.append(nxt)
            nxt = int(model.lm_head(model.hidden(torch.tensor(seq)[None]))[0, -1].argmax())
        p = "prompt_%d." % i
        positions = [len(prompt) - 1]
        tensors[p + "input_ids"] = ("I32", [len(prompt)], np.asarray(prompt, "<i4").tobytes())
        tensors[p + "positions"] = ("I32", [len(positions)], np.asarray(positions, "<i4").tobytes())
        tensors[p + "logits"] = ("F32", [len(positions), config["vocab_size"]],
                                 logits[positions].float().numpy().astype("<f4").tobytes())
        tensors[p + "greedy"] = ("I32", [greedy_tokens], np.asarray(greedy, "<i4").tobytes())
    safetensors_io.write(out_path, tensors, {"source": "tools/train_demo_model.py: tools/demo_model.py in float64 on "
                                             "the CPU (torch %s) from the exported bf16 weights" % torch.__version__})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".train")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=7.0, help="training wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU, to prove the pipeline")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=float, default=20.0, help="seconds between validation checks")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = copy.deepcopy(SMOKE_CONFIG if args.smoke else DEMO_CONFIG)
    if args.smoke:
        args.seq_len, args.batch, args.minutes, args.eval_every = 128, 4, min(args.minutes, 0.75), 15.0
    T = args.seq_len
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log("torch %s on %s%s" % (torch.__version__, device, " (%s)" % torch.cuda.get_device_name() if device.type == "cuda" else ""))

    kept = json.load(open(os.path.join(args.data, "kept.json")))
    prompts = json.load(open(os.path.join(args.data, "prompts.json")))
    record = json.load(open(os.path.join(args.data, "record.json")))
    index = {v: i for i, v in enumerate(kept)}
    train = torch.from_numpy(load_stream(os.path.join(args.data, "train.tokens.xz"))).to(device)
    val_chat = torch.from_numpy(load_stream(os.path.join(args.data, "val_chat.tokens.xz"))).to(device)
    val_plain = torch.from_numpy(load_stream(os.path.join(args.data, "val_plain.tokens.xz"))).to(device)
    log("data: train %d, val chat %d, val plain %d tokens; %d kept vocabulary rows" % (
        train.numel(), val_chat.numel(), val_plain.numel(), len(kept)))

    model = demo_model.DeepSeekV3(config, kept=kept)
    init_weights(model, config)
    model.eos_compact = index[EOS]
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    full_params = n_params + 2 * (config["vocab_size"] - len(kept)) * config["hidden_size"]
    log("parameters: %d trained (%d in the checkpoint's full-vocabulary layout)" % (n_params, full_params))

    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed_tokens" not in n)]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **fused)

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    budget = args.minutes * 60.0
    t_train = time.time()
    deadline = t_train + budget
    warmup = 0.03 * budget
    step = tokens = 0
    best = {"val": float("inf"), "state": None, "step": 0, "tokens": 0}
    next_eval = t_train + args.eval_every
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    history = []

    def check_val():
        model.eval()
        r = evaluate(model, torch.cat([val_chat, val_plain]), T, args.batch, 64 * 1024 if not args.smoke else 4096,
                     device, autocast)
        model.train()
        history.append({"step": step, "tokens": tokens, "seconds": round(time.time() - t_train, 1), **r})
        if r["main"] < best["val"]:
            best.update(val=r["main"], step=step, tokens=tokens,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})
        log("step %d tokens %.1fM: val main %.4f mtp %.4f (best %.4f at step %d)" % (
            step, tokens / 1e6, r["main"], r["mtp"], best["val"], best["step"]))

    model.train()
    while not STOP["now"]:
        now = time.time()
        if now >= deadline:
            break
        elapsed = now - t_train
        lr = args.lr * (elapsed / warmup if elapsed < warmup else
                        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (elapsed - warmup) / (budget - warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - T - 2, (args.batch,), device=device, generator=gen)
        batch = windows(train, starts, T + 2)
        with autocast():
            main, mtp, _, _ = losses(model, batch, T)
            loss = main + MTP_LAMBDA * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing (DeepSeek-V3 §2.1.2)
            for moe in moe_layers(model):
                load = moe.last_load
                moe.gate.e_score_correction_bias += BIAS_UPDATE_SPEED * torch.sign(load.mean() - load)
        step += 1
        tokens += args.batch * T
        if step % 100 == 0 or (args.smoke and step % 10 == 0):
            el = time.time() - t_train
            log("step %d lr %.2e loss %.4f mtp %.4f tokens %.1fM %.0f tok/s" % (
                step, lr, main.item(), mtp.item(), tokens / 1e6, tokens / el))
        if time.time() >= next_eval:
            check_val()
            next_eval = time.time() + args.eval_every
    train_seconds = time.time() - t_train
    log("training stopped after %d steps, %.1fM tokens, %.0fs" % (step, tokens / 1e6, train_seconds))
    check_val()
    model.load_state_dict(best["state"])
    model.eval()

    # Export first: whatever happens later, the checkpoint is written.
    t0 = time.time()
    json.dump(config, open(os.path.join(args.out, "config.json"), "w"), indent=2)
    files, bf16, packed_bytes = pack_artifact(model, config, args.out, kept)
    export_seconds = time.time() - t0

    t0 = time.time()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model.float()
    identity = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731
    val = {"chat": evaluate(model, val_chat, T, args.batch, 1 << 20 if not args.smoke else 8192, device, identity),
           "plain": evaluate(model, val_plain, T, args.batch, 1 << 20 if not args.smoke else 8192, device, identity)}
    held = [[index[t] for t in p] for p in prompts["held_out_chat_prompts"]]
    if args.smoke:
        held = held[:4]
    acceptance, generations = generate_and_accept(model, held, 16 if args.smoke else 128, device)
    eval_seconds = time.time() - t0
    t0 = time.time()
    reference_logits(bf16, config, prompts["reference_prompts"], os.path.join(args.out, "demo-reference.safetensors"))
    reference_seconds = time.time() - t0

    decode = lambda seq: [kept[t] if t >= 0 else None for t in seq]  # noqa: E731
    samples = [{"prompt_messages": prompts["held_out_chat_messages"][i],
                "generated_ids": decode(generations[i][len(held[i]):])} for i in range(min(4, len(held)))]
    metrics = {
        "config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                          "moe_intermediate_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank")},
        "parameters": {"trained": n_params, "checkpoint_full_vocabulary": full_params, "kept_vocabulary_rows": len(kept)},
        "data": record,
        "training": {"steps": step, "tokens_seen": tokens, "seconds": round(train_seconds, 1),
                     "tokens_per_second": round(tokens / max(train_seconds, 1e-9)), "epochs": tokens / train.numel(),
                     "batch_tokens": args.batch * T, "seq_len": T, "lr_peak": args.lr, "mtp_lambda": MTP_LAMBDA,
                     "bias_update_speed": BIAS_UPDATE_SPEED, "best_step": best["step"], "best_tokens": best["tokens"],
                     "history": history},
        "validation": {
            "chat": {"loss": val["chat"]["main"], "perplexity": math.exp(val["chat"]["main"]),
                     "mtp_loss": val["chat"]["mtp"], "top1_accuracy": val["chat"]["main_acc"],
                     "mtp_acceptance_teacher_forced": val["chat"]["mtp_acc"], "tokens": val["chat"]["tokens"]},
            "plain": {"loss": val["plain"]["main"], "perplexity": math.exp(val["plain"]["main"]),
                      "mtp_loss": val["plain"]["mtp"], "top1_accuracy": val["plain"]["main_acc"],
                      "mtp_acceptance_teacher_forced": val["plain"]["mtp_acc"], "tokens": val["plain"]["tokens"]},
        },
        "mtp_acceptance_greedy_held_out_chat": acceptance,
        "samples": samples,
        "artifact": {"files": [os.path.basename(f) for f in files], "packed_bytes": packed_bytes},
        "wall_seconds": {"total": round(time.time() - T_START, 1), "train": round(train_seconds, 1),
                         "export": round(export_seconds, 1), "eval": round(eval_seconds, 1),
                         "reference": round(reference_seconds, 1)},
        "torch": torch.__version__, "device": str(device),
    }
    json.dump(metrics, open(os.path.join(args.out, "metrics.json"), "w"), indent=1)
    log("validation chat: loss %.4f ppl %.2f top1 %.3f mtp-tf %.3f | plain: loss %.4f ppl %.2f" % (
        val["chat"]["main"], math.exp(val["chat"]["main"]), val["chat"]["main_acc"], val["chat"]["mtp_acc"],
        val["plain"]["main"], math.exp(val["plain"]["main"])))
    log("MTP acceptance (greedy, held-out chat): %.3f over %d positions; %d/%d generations ended with EOS" % (
        acceptance["mtp_acceptance_greedy"], acceptance["positions"], acceptance["ended_with_eos"], acceptance["prompts"]))
    log("done in %.1fs" % (time.time() - T_START))
    open(os.path.join(args.out, "train.log"), "w").write("\n".join(LOG_LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
