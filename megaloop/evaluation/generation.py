"""Text from a model with per-token early exit: what `megaloop generate` runs.

MODEL is an export, or a run directory or checkpoint folder exported for the command into a
temporary folder (harness.as_export). The export is opened as every measurement opens it
(megaloop.evaluation.exported: its code checked, megaloop's own classes, safetensors only) with
the exit rule, threshold, K and KV policy set in its config, and decoded by transformers'
`generate()` through a `LoopCache`, which records each forward's exit loops and counts the
loops run. A generated token's exit loop is the loop at which the forward that chose it
stopped: the prompt's last position's for the first new token, then each decoded token's.

One prompt is printed as it is generated; several are generated in left-padded batches and
each completion printed when its batch is done. `--show-depth` follows each token's text with
its exit loop as ⟨k⟩.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from megaloop.evaluation import exported, harness
from megaloop.evaluation.exported import placement
from megaloop.evaluation.settings import GenerateSettings, check_gate
from megaloop.model.decoding import LoopCache


def mark(depth: int) -> str:
    return f"⟨{depth}⟩"


class Detokenizer:
    """One row's new tokens as text, a token at a time: the text each token completes (a
    character split over several tokens comes with its last one), then, with `show_depth`, the
    marks of the tokens it took. Special tokens (end of text) print nothing."""

    def __init__(self, tokenizer, show_depth: bool):
        self.tokenizer, self.show_depth = tokenizer, show_depth
        self.special = set(tokenizer.all_special_ids)
        self.ids: list[int] = []
        self.printed = 0
        self.marks = ""

    def add(self, token: int, depth: int) -> str:
        self.ids.append(token)
        if self.show_depth and token not in self.special:
            self.marks += mark(depth)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
            return ""
        return self.take(text)

    def flush(self) -> str:
        return self.take(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def take(self, text: str) -> str:
        new, self.printed = text[self.printed :] + self.marks, len(text)
        self.marks = ""
        return new


class DepthStreamer(BaseStreamer):
    """Prints one row's completion as generate() produces it. Each token's exit loop is read
    from the cache when the token arrives: the forward that just ran chose it."""

    def __init__(self, detokenizer: Detokenizer, cache: LoopCache, out: TextIO):
        self.detokenizer, self.cache, self.out = detokenizer, cache, out
        self.step = -1  # the first put is the prompt

    def put(self, value: torch.Tensor) -> None:
        if self.step >= 0:
            depth = int(self.cache.exit_loops[self.step][0, -1])
            self.out.write(self.detokenizer.add(int(value.reshape(-1)[0]), depth))
            self.out.flush()
        self.step += 1

    def end(self) -> None:
        self.out.write(self.detokenizer.flush() + "\n")
        self.out.flush()


def open_export(settings: GenerateSettings, folder: Path):
    """The model of the export `folder` (MODEL's, harness.as_export), its config set to the
    settings' rule, threshold, K and KV policy, and its tokenizer padding on the left (with end
    of text, or id 0, as the pad)."""
    export = exported.open_export(folder)
    check_gate(settings.early_exit, bool(export.config.get("exit_gate")), settings.model)
    overrides = dict(early_exit=settings.early_exit, kv_policy=settings.kv)
    if settings.threshold is not None:
        overrides["exit_threshold"] = settings.threshold
    if settings.loops is not None:
        overrides["num_loops"] = settings.loops
    device, dtype = placement(settings.device, settings.dtype)
    model = export.model(device, dtype, **overrides)
    tokenizer = export.tokenizer()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    return model, tokenizer


def sampling(settings: GenerateSettings) -> dict:
    """generate()'s arguments for greedy decoding (temperature 0) or sampling."""
    if settings.temperature == 0:
        return {"do_sample": False}
    given = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    return {"do_sample": True, **{k: v for k, v in given.items() if v is not None}}


def sampler(settings: GenerateSettings):
    """For depth-asynchronous batching: logits [r, V] → ids [r], greedy (None: the argmax) or
    sampled through transformers' temperature, top-k and top-p warpers, as generate() does."""
    if settings.temperature == 0:
        return None
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_k is not None:
        warpers.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p is not None:
        warpers.append(TopPLogitsWarper(settings.top_p))

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        for warp in warpers:
            scores = warp(None, scores)
        return torch.multinomial(scores.softmax(-1), 1)[:, 0]

    return sample


def complete(model, tokenizer, texts: list[str], settings, cache, streamer=None) -> list[dict]:
    """Each prompt's completion: its text, new token ids and their exit loops (up to and with
    end of text; what a finished row is padded with afterwards is not its own)."""
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    with torch.no_grad():
        if settings.batching_of(len(texts)) == "async":
            new, depths = complete_async(model, tokenizer, batch, settings, cache)
        else:
            out = model.generate(
                **batch,
                max_new_tokens=settings.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                past_key_values=cache,
                streamer=streamer,
                **sampling(settings),
            )
            new = out[:, batch["input_ids"].shape[1] :].cpu()
            depths = torch.stack([e[:, -1] for e in cache.exit_loops[: new.shape[1]]], 1).cpu()
    results = []
    for text, ids, loops in zip(texts, new.tolist(), depths.tolist()):
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        results.append(
            {
                "prompt": text,
                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                "tokens": ids,
                "exit_loops": loops[: len(ids)],
            }
        )
    return results


def complete_async(model, tokenizer, batch, settings, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """New ids [b, n] and their exit loops, decoded into `cache` by depth-asynchronous
    batching."""
    out = model.decode_async(
        batch["input_ids"],
        new_tokens=settings.max_new_tokens,
        attention_mask=batch.get("attention_mask"),
        sample=sampler(settings),
        eos_token_id=tokenizer.eos_token_id,
        cache=cache,
    )
    first = cache.exit_loops[0][:, -1:]  # the prompt's last position picks the first token
    return out.tokens.cpu(), torch.cat([first, out.exit_loops], 1)[:, : out.tokens.shape[1]].cpu()


def marked(tokenizer, result: dict, show_depth: bool) -> str:
    """A finished completion as the stream prints it."""
    detokenizer = Detokenizer(tokenizer, show_depth)
    text = "".join(detokenizer.add(t, d) for t, d in zip(result["tokens"], result["exit_loops"]))
    return text + detokenizer.flush()


def run(settings: GenerateSettings, out: TextIO | None = None, err: TextIO | None = None) -> dict:
    """Generate, print on `out` (streamed for one prompt), then the summary on `err` (default:
    standard output and error); returns the model it ran (MODEL as given, and the checkpoint
    step of a run), the prompts' results and the summary (written to settings.out too, when
    given)."""
    out, err = out or sys.stdout, err or sys.stderr
    texts = settings.texts()
    with harness.as_export(settings.model) as (folder, source):
        model, tokenizer = open_export(settings, folder)
    trained = model.config.num_loops_trained
    notes = [settings.threshold_note()]
    if settings.loops is not None and settings.loops > trained:
        notes.append(
            f"--loops {settings.loops} runs past the depth the model was trained at "
            f"(K_train = {trained}): loops beyond it were never trained to help, and each one "
            "costs a stack application a token"
        )
    for note in filter(None, notes):
        print(f"megaloop generate: note: {note}", file=err)
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    else:  # unseeded, though exporting a run seeded torch (distributed.init)
        torch.seed()
    size = settings.batch_size
    chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
    results, caches, seconds, engines = [], [], 0.0, {}
    for chunk in chunks if len(texts) == 1 else harness.progress(chunks, "generate"):
        cache = LoopCache(settings.kv)
        streamer = None
        if len(texts) == 1 and settings.batching_of(1) == "sync":
            streamer = DepthStreamer(Detokenizer(tokenizer, settings.show_depth), cache, out)
            out.write(chunk[0])
        start = time.perf_counter()
        done = complete(model, tokenizer, chunk, settings, cache, streamer)
        seconds += time.perf_counter() - start  # complete() waited for the device: .cpu()
        results += done
        caches.append(cache)
        engines[settings.batching_of(len(chunk))] = None  # an ordered set
        if streamer is None:
            for r in done:  # above the progress bar
                tqdm.write(f"{r['prompt']}{marked(tokenizer, r, settings.show_depth)}\n", file=out)
    summary = summarize(results, caches, seconds, model.config.num_loops, settings.kv)
    summary["batching"] = list(engines)  # what auto chose: a last, shorter chunk may differ
    print(summary_line(summary), file=err)
    record = {
        "settings": settings_record(settings),
        "model": source,
        "results": results,
        "summary": summary,
    }
    if settings.out is not None:
        settings.out.parent.mkdir(parents=True, exist_ok=True)
        settings.out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


def summarize(results: list[dict], caches: list[LoopCache], seconds: float, K: int, kv: str):
    """New tokens, their mean exit loop, the loops applied (prompts included), the cache's
    bytes per token and tokens/s (new tokens over the time of generate(), prefill included)."""
    loops = [k for r in results for k in r["exit_loops"]]
    return {
        "new_tokens": len(loops),
        "mean_exit_loop": sum(loops) / len(loops) if loops else None,
        "num_loops": K,
        "loop_applications": sum(c.loop_applications for c in caches),
        "kv": kv,
        "kv_bytes_per_token": caches[0].bytes_per_token(),
        "seconds": seconds,
        "tokens_per_s": len(loops) / seconds if seconds > 0 else None,
    }


def summary_line(s: dict) -> str:
    mean = "-" if s["mean_exit_loop"] is None else f"{s['mean_exit_loop']:.2f}"
    rate = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"
    return (
        f"megaloop generate: {s['new_tokens']} new tokens, mean exit loop {mean} of "
        f"K={s['num_loops']}, {s['loop_applications']} loop applications, KV cache "
        f"{s['kv_bytes_per_token'] / 1024:.1f} KiB/token ({s['kv']}), {rate} tokens/s"
    )


def settings_record(settings: GenerateSettings) -> dict:
    """The settings as the JSON records them (GenerateSettings(**record) rebuilds them)."""
    record = {k: v for k, v in vars(settings).items() if k != "out"}
    return {
        **record,
        "model": str(settings.model),
        "prompts": settings.prompts and str(settings.prompts),
    }
