"""``trainforge generate``: one prompt through the inference engine, text or token ids out."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.errors import TrainforgeError
from trainforge.infer.session_options import SessionOptions

DESCRIPTION = "Generate from a checkpoint with the inference engine."


@dataclass
class GenerateOptions:
    prompt: str | None = _f(None, "text to continue (needs the checkpoint's tokenizer.json); this or --prompt_ids")
    prompt_ids: str | None = _f(None, "token ids to continue, comma-separated: 1,2,3", metavar="IDS")
    print_ids: bool = _f(False, "print the generated token ids instead of text")
    max_new_tokens: int = _f(64, "tokens to generate at most")
    temperature: float = _f(0.8, "0 = greedy")
    top_k: int = _f(0, "0 = off")
    top_p: float = _f(1.0, "1 = off")
    repetition_penalty: float = _f(1.0, "1 = off")
    stop: list[str] = _f((), "stop string", append=True, metavar="TEXT")
    ignore_eos: bool = _f(False, "do not stop at the end-of-text token")
    seed: int = _f(0, "sampling seed (same seed, same text)")
    stats: bool = _f(False, "print engine statistics (tok/s, KV pool) to stderr")


SECTIONS = {"model and engine": SessionOptions, "generation": GenerateOptions}
COMMAND = Command("generate", DESCRIPTION, SECTIONS, model="checkpoint")


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    opts, g = parsed.section(SessionOptions), parsed.section(GenerateOptions)
    if (g.prompt is None) == (g.prompt_ids is None):
        raise TrainforgeError("give one of --prompt TEXT or --prompt_ids IDS" if g.prompt is None else
                              "argument --prompt_ids: not allowed with argument --prompt")
    from trainforge.infer.sampling import SamplingParams
    from trainforge.infer.session import inference_mode, speculative_args

    params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                            top_p=g.top_p, repetition_penalty=g.repetition_penalty, stop=tuple(g.stop),
                            ignore_eos=g.ignore_eos, seed=g.seed)
    try:
        params.validate()
        ids = [int(t) for t in g.prompt_ids.split(",") if t.strip()] if g.prompt_ids is not None else None
    except ValueError as e:
        raise TrainforgeError(f"--{str(e)}" if not str(e).startswith("invalid literal") else
                              f"--prompt_ids {g.prompt_ids!r}: give comma-separated integers") from None
    spec = speculative_args(opts)
    # The engine's pool (below) holds one context; a text prompt has at most one token per byte.
    prompt_len = len(ids) if ids is not None else len(g.prompt.encode())
    ahead = opts.num_speculative_tokens if spec else 0
    with inference_mode():
        return _generate(opts, g, params, ids, spec, prompt_len, ahead)


def _generate(opts, g, params, ids: list[int] | None, spec, prompt_len: int, ahead: int) -> int:
    from trainforge.infer.engine import Engine
    from trainforge.infer.server_limits import TokenizerFailed, tokenizer_call
    from trainforge.infer.session import engine_config, freeze_long_lived, load_drafter, load_for_engine

    loaded = load_for_engine(opts, kv_slots=lambda cfg: (-(-(min(cfg.max_seq_len, prompt_len + g.max_new_tokens)
                                                              + ahead) // 16) + 1) * 16)
    # Text in or out (a text prompt, printed text, stop strings) needs the tokenizer; ids in and
    # out do not, and a GGUF file's is then never built (``LoadedModel.tokenizer``).
    tok = loaded.tokenizer if g.prompt is not None or not g.print_ids or g.stop else None
    if ids is None:
        if tok is None:
            raise TrainforgeError(f"{opts.checkpoint} has no tokenizer.json: use --prompt_ids")
        try:  # a tokenizer.json regex can panic on some text (Oniguruma's retry limit): one line, not a traceback
            ids = tokenizer_call(tok.encode, g.prompt).ids
        except TokenizerFailed as e:
            raise TrainforgeError(f"{opts.checkpoint}: its tokenizer failed on --prompt ({e}); fix its "
                                  "tokenizer.json or give --prompt_ids") from None
    try:
        engine = Engine(loaded.model, engine_config(opts, max_batch_size=1, max_queue=1,
                                                    max_context=min(loaded.model.cfg.max_seq_len,
                                                                    len(ids) + g.max_new_tokens)),
                        tokenizer=tok, eos_ids=loaded.eos_ids, drafter=load_drafter(opts, spec, loaded))
        freeze_long_lived()
        req = engine.generate([ids], params)[0]
    except ValueError as e:
        raise TrainforgeError(str(e)) from None
    if req.finish_reason == "error":  # the engine failed it (its detokenisation, say): Request.error says why
        raise TrainforgeError(f"{opts.checkpoint}: {req.error}")
    if g.print_ids or tok is None:
        print(",".join(map(str, req.output_ids)))
    else:
        # decode(prompt + output) keeps characters split across the boundary intact; a stop
        # string cut the output's text, which then follows the prompt's.
        cut = req.finish_reason == "stop" and params.stop
        try:
            text = tokenizer_call(tok.decode, ids if cut else ids + req.output_ids) + (req.text if cut else "")
        except TokenizerFailed as e:
            raise TrainforgeError(f"{opts.checkpoint}: its tokenizer failed to decode the output ({e}); fix its "
                                  "tokenizer.json or use --print_ids") from None
        print(text)
    if g.stats:
        import json

        print(json.dumps(engine.stats(), default=str), file=sys.stderr)
    return 0
