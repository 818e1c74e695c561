"""Count the training tokens of a conversation file at several `data.max_length` values: the numbers
`peagle plan` takes by default for a dataset (peagle_train/plan.py `DATA_COUNTS`).

    python benchmarks/count_data_tokens.py [--data pkg:sharegpt] [--max-lengths 512,1024,2048,4096,8192]
                                        [--tokens-per-step 2048,4096,8192,16384] [--num-proc 1]

Runs `prepare_data` on every conversation (num_conversations=None) with SmolLM2-135M-Instruct's
tokenizer and chat template (the only tokenizer shipped with the package; a 128k-150k vocabulary
tokenizer cuts the same text into fewer tokens) at each max_length, then packs the kept rows with the
trainer's own `pack_documents` (seed 0) at each tokens_per_step. Prints, per max_length, the rows
kept, their tokens and supervised tokens, and per tokens_per_step the packed rows and their fill
(tokens / (rows × tokens_per_step)), as a table and as the Python literal plan.py holds.
"""

from __future__ import annotations

import argparse
import tempfile

from peagle_train.data.prepare import prepare_data
from peagle_train.features.rows import pack_documents
from peagle_train.paths import resolve_path


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from peagle_train.target.load import load_target_config, model_source

    return (AutoTokenizer.from_pretrained(model_source("pkg:smollm2"), local_files_only=True),
            load_target_config("pkg:smollm2").vocab_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="pkg:sharegpt")
    ap.add_argument("--max-lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--tokens-per-step", default="2048,4096,8192,16384")
    ap.add_argument("--num-proc", type=int, default=1)
    args = ap.parse_args()
    tok, vocab_size = smollm2_tokenizer()
    steps = [int(x) for x in args.tokens_per_step.split(",")]
    counts = {}
    print("| max_length | rows kept | tokens | supervised tokens | " + " | ".join(f"fill at {s}" for s in steps) + " |")
    print("|---" * (4 + len(steps)) + "|")
    with tempfile.TemporaryDirectory() as cache:
        for L in [int(x) for x in args.max_lengths.split(",")]:
            data = prepare_data(resolve_path(args.data), tok, vocab_size, num_conversations=None, max_length=L,
                                min_supervised_tokens=16, draft_vocab_size=8192, num_proc=args.num_proc,
                                cache_dir=cache)
            lengths = [len(x) for x in data.rows["input_ids"]]
            fills = {s: sum(lengths) / (len(pack_documents(lengths, s, 0)) * s) for s in steps}
            s = data.summary
            counts[L] = (s["conversations_kept"], s["tokens"], s["supervised_tokens"])
            print(f"| {L} | {s['conversations_kept']:,} | {s['tokens']:,} | {s['supervised_tokens']:,} | "
                  + " | ".join(f"{fills[x]:.4f}" for x in steps) + " |", flush=True)
    print("\n" + repr({args.data: counts}))


if __name__ == "__main__":
    main()
