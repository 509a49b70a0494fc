"""`jaxengine generate ...`: command-line entry points. Engine flags mirror `EngineConfig` fields."""

import argparse
import dataclasses
import json
import logging
import sys
import typing

from jaxengine.config import VLLM_SETTINGS, EngineConfig


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _json_flag(value: str, expected: str, valid) -> object:
    """`value` parsed as JSON where `valid(parsed)`; otherwise an argparse error saying what was `expected`."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r} ({e})") from None
    if not valid(parsed):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return parsed


def json_object(value: str) -> dict:
    """An argparse type: a JSON object (a dict), else a clear error."""
    return _json_flag(value, "a JSON object", lambda parsed: isinstance(parsed, dict))


def json_strings(value: str) -> list[str]:
    """An argparse type: a JSON list of strings (as vLLM's --allowed-origins takes), else a clear error."""
    return _json_flag(value, "a JSON list of strings",
                      lambda parsed: isinstance(parsed, list) and all(isinstance(item, str) for item in parsed))


def lora_module(value: str) -> tuple[str, str]:
    """An argparse type: one of vLLM's --lora-modules, `name=path` or '{"name": ..., "path": ...}'."""
    if value.lstrip().startswith("{"):
        spec = json_object(value)
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ...}}, got {value!r}")
        return spec["name"], spec["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return name, path


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field. A boolean one is written as vLLM writes it (`--enable-prefix-caching`,
    `--no-enable-prefix-caching`) or with a value (`--enable-prefix-caching false`)."""
    parser.add_argument("--config", help="YAML file of engine settings (see configs/); flags override it")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = next(t for t in typing.get_args(field.type) or (field.type,) if t is not type(None))
        if kind is bool:
            parser.add_argument(flag, dest=field.name, type=_bool, nargs="?", const=True, default=None,
                                help=f"(default: {field.default})")
            parser.add_argument("--no-" + flag[2:], dest=field.name, action="store_const", const=False,
                                help=f"the same as {flag} false")
        else:
            parser.add_argument(flag, dest=field.name, type=json_object if kind is dict else kind, default=None,
                                help=f"(default: {field.default})")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if args.config:
        return EngineConfig.from_yaml(args.config, **overrides)
    return EngineConfig(**{k: v for k, v in overrides.items() if v is not None})


def _generate(args) -> None:
    from jaxengine.llm import LLM
    from jaxengine.sampling_params import SamplingParams

    llm = LLM(config=engine_config(args))
    # Flags given, else the model's generation-config defaults, else greedy and 32 tokens.
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "max_tokens")
             if getattr(args, name) is not None}
    fields = {"temperature": 0.0, "max_tokens": 32} | llm.engine.default_sampling | given
    params = SamplingParams(**fields, seed=args.seed_sampling, ignore_eos=args.ignore_eos)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        for completion in out.outputs:
            print(completion.text)


def _serve(args) -> None:
    import os

    import uvicorn

    from jaxengine import profiler
    from jaxengine.engine.dp_engine import create_engine
    from jaxengine.engine.llm_engine import LLMEngine
    from jaxengine.lora import LoRARequest
    from jaxengine.parallel import multihost
    from server.app import build_app
    from server.engine_client import AsyncEngine
    from server.metrics import EngineMetrics
    from server.responses import ResponseStore
    from server.serving import load_chat_template

    AsyncEngine.check_max_log_len(args.max_log_len)
    ResponseStore.check_capacity(args.responses_store_size)  # before the model loads
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{flag}: no such file {path!r}")
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together (as in vLLM)")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    config = engine_config(args)
    if args.distributed:
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id,
                             args.heartbeat_timeout)
        if not multihost.is_leader():  # followers run the leader's device commands until it stops
            LLMEngine(config).runner.follow()
            return
    names = args.served_model_name or [config.model or "jaxengine-demo"]
    engine = create_engine(config)
    async_engine = AsyncEngine(engine, EngineMetrics(names[0]),
                               log_stats_interval=None if args.disable_log_stats else 10.0,
                               log_requests=args.enable_log_requests, max_log_len=args.max_log_len)
    cors = {"allow_origins": args.allowed_origins, "allow_credentials": args.allow_credentials,
            "allow_methods": args.allowed_methods, "allow_headers": args.allowed_headers}
    app = build_app(async_engine, names, api_key=args.api_key or os.environ.get("JAXENGINE_API_KEY") or None,
                    request_id_headers=args.enable_request_id_headers, cors=cors, chat_template=chat_template,
                    trust_request_chat_template=args.trust_request_chat_template,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    tool_call_parser=args.tool_call_parser,
                    lora_modules=[LoRARequest(name, i + 1, path)
                                  for i, (name, path) in enumerate(args.lora_modules or [])],
                    runtime_lora_updating=_bool(os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") or "false"),
                    responses_store_size=args.responses_store_size)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    finally:
        async_engine.shutdown()
        if (trace := profiler.stop_if_running()) is not None:  # a profile started and never stopped
            logging.getLogger(__name__).info("wrote the running profile into %s at shutdown", trace)
        if args.distributed:
            engine.runner.stop_followers()


def _convert(args) -> None:
    from jaxengine.models.loader import load_model, resolve_model_dir
    from jaxengine.models.orbax_io import save_converted

    model_dir = resolve_model_dir(args.model)
    model, _ = load_model(model_dir, args.dtype)
    save_converted(model, model_dir, args.output)
    print(f"wrote an Orbax checkpoint to {args.output}; serve it with --model {args.output}")


def _quantize(args) -> None:
    from jaxengine.models.loader import resolve_model_dir
    from jaxengine.models.quantization import (write_awq_checkpoint, write_fp8_checkpoint, write_gptq_checkpoint,
                                               write_w4a16_checkpoint, write_w8a8_checkpoint)

    model, group = resolve_model_dir(args.model), 128 if args.group_size is None else args.group_size
    if args.scheme in ("w8a8", "fp8", "fp8-dynamic") and (args.group_size is not None or args.zero_point):
        raise ValueError("--group-size and --zero-point apply to the 4-bit schemes (w4a16, gptq, awq)")
    if args.scheme == "awq" and args.zero_point is False:
        raise ValueError("awq checkpoints hold zero points (--no-zero-point: use w4a16 or gptq)")
    if args.scheme == "w8a8":
        write_w8a8_checkpoint(model, args.output)
    elif args.scheme == "w4a16":
        write_w4a16_checkpoint(model, args.output, group, symmetric=not args.zero_point)
    elif args.scheme in ("fp8", "fp8-dynamic"):
        write_fp8_checkpoint(model, args.output, (128, 128) if args.scheme == "fp8" else None,
                             "fp8" if args.scheme == "fp8" else "compressed-tensors")
    elif args.scheme == "gptq":
        write_gptq_checkpoint(model, args.output, group, symmetric=not args.zero_point,
                              checkpoint_format="gptq_v2" if args.zero_point else "gptq")
    else:
        write_awq_checkpoint(model, args.output, group)
    kind = {"w8a8": "W8A8 (compressed-tensors)", "w4a16": "W4A16 (compressed-tensors)", "gptq": "GPTQ",
            "awq": "AWQ", "fp8": "FP8 (blocks of 128 x 128)", "fp8-dynamic": "FP8 (compressed-tensors, per channel)"
            }[args.scheme]
    print(f"wrote a {kind} checkpoint to {args.output}; serve it with --model {args.output}")


def main(argv: list[str] | None = None) -> None:
    from server.tool_parsers import TOOL_CALL_PARSERS

    parser = argparse.ArgumentParser(prog="jaxengine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts offline and print the completions")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=None, help="default: the model's generation config, else 32")
    gen.add_argument("--temperature", type=float, default=None,
                     help="default: the model's generation config, else 0 (greedy)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_flags(gen)
    gen.set_defaults(run=_generate)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", nargs="+", default=None,
                       help="require 'Authorization: Bearer KEY' with one of these keys (or JAXENGINE_API_KEY)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the model name(s) clients may send, the first in responses (default: --model)")
    serve.add_argument("--ssl-keyfile", default=None, help="serve https with this private key (and --ssl-certfile)")
    serve.add_argument("--ssl-certfile", default=None, help="the certificate for --ssl-keyfile")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (its file, or the template itself) over the tokenizer's")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="take a chat request's own chat_template (refused otherwise, as in vLLM)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens 'token_id:N' (a request's return_tokens_as_token_ids overrides)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice 'auto': tool calls parsed from outputs (with --tool-call-parser)")
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how outputs write tool calls (hermes: Qwen 2.5/3, Hermes; llama3_json: Llama 3.1+)")
    serve.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                       help="LoRA adapters served by name (with --enable-lora): name=path, or a JSON object "
                            "'{\"name\": ..., \"path\": ...}'")
    serve.add_argument("--responses-store-size", type=int, default=1024,
                       help="Responses API responses kept in memory for previous_response_id and GET "
                            "/v1/responses/{id} (the newest; 0 keeps none)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug", "trace"))
    serve.add_argument("--allowed-origins", type=json_strings, default=[],
                       help='origins browsers may call from, e.g. \'["http://localhost:3000"]\' (default: none)')
    serve.add_argument("--allow-credentials", action="store_true", help="let cross-origin requests send credentials")
    serve.add_argument("--allowed-methods", type=json_strings, default=["*"], help="JSON list (default: all)")
    serve.add_argument("--allowed-headers", type=json_strings, default=["*"], help="JSON list (default: all)")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic log line of throughput, running and waiting requests and cache usage")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it arrives (prompt, token ids, sampling parameters), finishes or "
                            "is aborted")
    serve.add_argument("--max-log-len", type=int, default=None,
                       help="with --enable-log-requests: the prompt characters and token ids logged (default: all)")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="add an X-Request-Id header to every response (the request's, or a random id)")
    serve.add_argument("--distributed", action="store_true",
                       help="multi-host: jax.distributed.initialize; process 0 serves, the others follow")
    serve.add_argument("--coordinator-address", default=None, help="host:port of process 0 (default: from the "
                       "environment, as Cloud TPU VMs provide)")
    serve.add_argument("--num-processes", type=int, default=None)
    serve.add_argument("--process-id", type=int, default=None)
    serve.add_argument("--heartbeat-timeout", type=int, default=30,
                       help="seconds before a dead process makes the others fail")
    add_engine_flags(serve)
    serve.set_defaults(run=_serve)
    convert = sub.add_parser("convert", help="write an Orbax checkpoint of the converted parameters")
    convert.add_argument("--model", required=True, help="Hugging Face directory or hub id")
    convert.add_argument("--output", required=True, help="a new directory for the checkpoint")
    convert.add_argument("--dtype", default="auto")
    convert.set_defaults(run=_convert)
    quantize = sub.add_parser("quantize", help="write a quantized checkpoint of a float one, round to nearest (no "
                                               "calibration): compressed-tensors W8A8 int8 (per-channel weights, "
                                               "per-token activations) or W4A16 (int4 weights in groups), GPTQ or "
                                               "AWQ (int4 weights in groups), FP8 (e4m3 weights in blocks of 128 x "
                                               "128, or compressed-tensors' FP8_DYNAMIC: per channel)")
    quantize.add_argument("--model", required=True, help="Hugging Face directory or hub id of a dense model")
    quantize.add_argument("--output", required=True, help="a new directory for the checkpoint")
    quantize.add_argument("--scheme", choices=("w8a8", "w4a16", "gptq", "awq", "fp8", "fp8-dynamic"), default="w8a8")
    quantize.add_argument("--group-size", type=int, default=None,
                          help="4-bit schemes: inputs per group of scales (default 128; 0: one group per output "
                               "channel)")
    quantize.add_argument("--zero-point", action=argparse.BooleanOptionalAction, default=None,
                          help="4-bit schemes: asymmetric, a zero point per group (awq: always; gptq: written in "
                               "the gptq_v2 format)")
    quantize.set_defaults(run=_quantize)
    from jaxengine.bench import add_bench_parser

    add_bench_parser(sub)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        names = [flag.split("=")[0].removeprefix("--").removeprefix("no-").replace("-", "_") for flag in extra
                 if flag.startswith("--")]
        hints = [f"--{name.replace('_', '-')}: {VLLM_SETTINGS[name]}" for name in names if name in VLLM_SETTINGS]
        parser.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {hint}" for hint in hints))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        if getattr(args, "passthrough", False):
            args.run(args, extra)
        else:
            args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
