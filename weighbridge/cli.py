"""The ``weighbridge`` command line. Thin: it validates flags and hands off to the parts."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    name="weighbridge",
    help="Token-aware multi-tenant fair scheduling and measurement for vLLM serving.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Token-aware multi-tenant fair scheduling and measurement for vLLM serving."""


@app.command()
def emulator(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
    model_name: Annotated[str, typer.Option(help="Model name served and checked.")] = (
        "weighbridge-emulator"),
    profile: Annotated[str, typer.Option(
        help="Step-time profile: cpu-tiny or h100-llama3-8b (docs/emulator.md).")] = "cpu-tiny",
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences running at once.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(
        help="Token budget B of one step.")] = 2048,
    num_kv_blocks: Annotated[int, typer.Option(help="KV-cache size in blocks.")] = 512,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    max_model_len: Annotated[int, typer.Option(
        help="Longest prompt + output accepted.")] = 4096,
    scheduling_policy: Annotated[str, typer.Option(
        help="Waiting-queue order: fcfs or priority (by the request's priority field).")] = "fcfs",
    long_prefill_token_threshold: Annotated[int, typer.Option(
        help="Most prompt tokens one sequence prefills per step (0: no cap), as vLLM's "
             "flag of the same name.")] = 0,
    no_chunked_prefill: Annotated[bool, typer.Option(
        "--no-chunked-prefill",
        help="Steps are all-prefill or all-decode (vLLM V0) instead of mixed.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the output-length draws.")] = 0,
    mean_output_tokens: Annotated[float, typer.Option(
        help="Mean output length when a request does not set ignore_eos.")] = 128.0,
    vocab_size: Annotated[int, typer.Option(help="Token ids must be below this.")] = 32000,
    t_fixed: Annotated[float | None, typer.Option(help="Override: seconds per step.")] = None,
    t_prefill_token: Annotated[float | None, typer.Option(
        help="Override: seconds per prefill token.")] = None,
    t_decode_seq: Annotated[float | None, typer.Option(
        help="Override: seconds per decoding sequence.")] = None,
    t_kv_token: Annotated[float | None, typer.Option(
        help="Override: seconds per KV token attended.")] = None,
    t_api_serial: Annotated[float | None, typer.Option(
        help="Override: API-server seconds per request, one request at a time.")] = None,
    t_api_latency: Annotated[float | None, typer.Option(
        help="Override: API-server latency per request, in parallel.")] = None,
) -> None:
    """Serve a vLLM-compatible engine emulator (OpenAI API and vLLM's /metrics)."""
    from emulator.engine import EngineConfig
    from emulator.profiles import get_profile
    from emulator.server import EmulatorSettings, run_emulator

    try:
        step_profile = get_profile(profile).with_overrides(
            t_fixed=t_fixed, t_prefill_token=t_prefill_token, t_decode_seq=t_decode_seq,
            t_kv_token=t_kv_token, t_api_serial=t_api_serial, t_api_latency=t_api_latency)
        engine = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
            chunked_prefill=not no_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    settings = EmulatorSettings(model_name=model_name, engine=engine, profile_name=profile,
                                seed=seed, mean_output_tokens=mean_output_tokens,
                                vocab_size=vocab_size)
    typer.echo(f"weighbridge emulator: {model_name} on http://{host}:{port} "
               f"(profile {profile}, {max_num_seqs} seqs, B={max_num_batched_tokens}, "
               f"{num_kv_blocks}x{block_size} KV tokens)", err=True)
    run_emulator(settings, step_profile, host, port)


@app.command()
def sidecar(
    config: Annotated[str, typer.Option("--config", help="Tenants/tiers/backends YAML file.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Serve the fair-scheduling sidecar in front of vLLM backends (docs/sidecar.md)."""
    import logging

    from sidecar.app import run_sidecar
    from weighbridge.config import ConfigError, load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        loaded = load_config(config)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    typer.echo(f"weighbridge sidecar on http://{host}:{port}: {len(loaded.tenants)} tenants, "
               f"{len(loaded.backends)} backends, policy {loaded.scheduler.policy}, "
               f"routing {loaded.routing}", err=True)
    run_sidecar(loaded, host, port)


@app.command("hash-key")
def hash_key(key: Annotated[str, typer.Argument(help="The raw API key.")]) -> None:
    """Print the sha256:<hex> form of an API key, for api_keys in the config."""
    from weighbridge.config import hash_api_key

    typer.echo(hash_api_key(key))


def main() -> None:
    app()
