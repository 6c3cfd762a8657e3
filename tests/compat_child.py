"""One matrix cell: run in a venv holding one transformers version, as a user WITHOUT ghosted_hf.

    python compat_child.py SPEC.json

SPEC names the saved folders and their reference outputs (written by compat_matrix.py with the current code
on the system's transformers). Every folder is loaded with `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)` and checked; one JSON line is printed per (model, check):
``{"model": ..., "check": ..., "ok": true|false, "error": "first line"}``.

Only the standard library, torch, safetensors and transformers are imported here: this file must not depend on
ghosted_hf or on the rest of tests/.
"""

import sys

if __name__ == "__main__":  # (compat_matrix.py imports CHECKS from here and needs ghosted_hf itself)
    sys.modules["ghosted_hf"] = None  # any import of ghosted_hf now raises ImportError
    # The venv sees the system's packages (for torch), among them the `kernels` that transformers 5.25
    # requires; kernels >= 0.19 raises at import time inside transformers <= 5.10's hub_kernels module. Hub
    # kernels are an optional GPU integration a CPU run never uses: hide them so each venv imports the
    # transformers it pins, not a pairing no user of that version would have.
    sys.modules["kernels"] = None

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import struct  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

CHECKS = (
    "load", "config", "logits", "return_tuple", "generate_cache", "loss", "hidden_states", "pipeline",
    "bf16_fp32_operators", "missing_operator", "tampered_operator", "wrong_shape", "resave", "format_version",
)


RESULTS = sys.stdout  # results only; anything else printed (prompts, progress) goes to stderr


def emit(model: str, check: str, ok: bool, error: str = "") -> None:
    print(json.dumps({"model": model, "check": check, "ok": ok, "error": error}), file=RESULTS, flush=True)


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def rewrite_checkpoint(folder: Path, target: Path, edit) -> None:
    """Copy `folder` to `target` with `edit(header, data)` applied to model.safetensors' header and bytes."""
    shutil.copytree(folder, target)
    path = target / "model.safetensors"
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    data = bytearray(raw[8 + size:])
    header, data = edit(header, data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))


def drop_tensor(key: str):
    def edit(header, data):
        start, end = header.pop(key)["data_offsets"]
        out = bytearray()
        entries = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
        for _, name in entries:
            a, b = header[name]["data_offsets"]
            header[name]["data_offsets"] = [len(out), len(out) + (b - a)]
            out += data[a:b]
        return header, out
    return edit


def flip_byte(key: str):
    def edit(header, data):
        start, end = header[key]["data_offsets"]
        data[start + (end - start) // 2] ^= 0x01
        return header, data
    return edit


def grow_tensor(key: str):
    """Make `key` one row and column larger (identity padding), as a checkpoint of another width would be."""
    def edit(header, data):
        import array

        entry = header[key]
        n = entry["shape"][0]
        a, b = entry["data_offsets"]
        old = array.array("f", bytes(data[a:b]))
        new = array.array("f", [0.0] * (n + 1) ** 2)
        for i in range(n):
            new[i * (n + 1):i * (n + 1) + n] = old[i * n:(i + 1) * n]
        new[-1] = 1.0
        entry["shape"] = [n + 1, n + 1]
        moved = new.tobytes()
        out = bytearray(data[:a]) + moved + bytearray(data[b:])
        for other in header.values():
            if isinstance(other, dict) and "data_offsets" in other and other is not entry and other["data_offsets"][0] >= b:
                other["data_offsets"] = [o + len(moved) - (b - a) for o in other["data_offsets"]]
        entry["data_offsets"] = [a, a + len(moved)]
        return header, out
    return edit


def expect_refusal(load, folder: Path, key: str) -> None:
    try:
        load(folder)
    except ValueError as exc:
        if key not in str(exc):
            raise AssertionError(f"refused without naming {key}: {first_line(exc)}") from None
        return
    raise AssertionError(f"checkpoint with a broken {key} loaded without error")


def run_model(name: str, spec: dict, work: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    folder = Path(spec["folder"])
    ref = load_file(spec["reference"])
    meta = spec["meta"]

    def load(path, **kwargs):
        return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, **kwargs).eval()

    def check(check_name, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is a matrix cell
            emit(name, check_name, False, first_line(exc))
            if os.environ.get("GHOSTED_COMPAT_TRACEBACK"):
                traceback.print_exc(file=sys.stderr)
        else:
            emit(name, check_name, True)

    state = {}

    def do_load():
        model = load(folder)
        module = type(model).__module__
        if not module.startswith("transformers_modules"):
            raise AssertionError(f"class came from {module}, not from the folder's remote code")
        if sys.modules.get("ghosted_hf") is not None:
            raise AssertionError("ghosted_hf got imported")
        state["model"] = model

    check("load", do_load)
    model = state.get("model")
    if model is None:
        for check_name in CHECKS[1:]:
            emit(name, check_name, False, "not loaded")
        return
    inputs = {"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"]}

    def do_config():
        c = model.config
        got = {k: getattr(c, k, "<missing>") for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
        if got != meta["config"]:
            raise AssertionError(f"config fields {got} != {meta['config']}")

    def do_logits():
        with torch.no_grad():
            logits = model(**inputs).logits
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)

    def do_return_tuple():
        with torch.no_grad():
            out = model(**inputs, return_dict=False)
        if not isinstance(out, tuple):
            raise AssertionError(f"return_dict=False gave {type(out).__name__}")
        torch.testing.assert_close(out[0], ref["logits"], rtol=0, atol=1e-5)

    def do_generate():
        kwargs = dict(**inputs, max_new_tokens=meta["new_tokens"], do_sample=False, pad_token_id=meta["pad"])
        with torch.no_grad():
            cached = model.generate(**kwargs, use_cache=True)
            uncached = model.generate(**kwargs, use_cache=False)
        if not torch.equal(cached, uncached):
            raise AssertionError(f"cache {cached[:, -meta['new_tokens']:].tolist()} != "
                                 f"no cache {uncached[:, -meta['new_tokens']:].tolist()}")
        if not torch.equal(cached, ref["generated"]):
            raise AssertionError(f"tokens {cached[:, -meta['new_tokens']:].tolist()} != saving version's "
                                 f"{ref['generated'][:, -meta['new_tokens']:].tolist()}")

    def do_loss():
        labels = ref["labels"]
        with torch.no_grad():
            out = model(**inputs, labels=labels)
        manual = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        if out.loss is None or not torch.isfinite(out.loss):
            raise AssertionError(f"loss is {out.loss}")
        torch.testing.assert_close(out.loss, manual, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.loss, ref["loss"], rtol=0, atol=1e-5)

    def do_hidden_states():
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
        states = out.hidden_states
        if states is None or len(states) != meta["kept"] + 1:
            raise AssertionError(f"{None if states is None else len(states)} hidden states for {meta['kept']} layers")

    def do_pipeline():
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer, trust_remote_code=True)
        out = generator("hello world", max_new_tokens=4, do_sample=False)
        text = out[0]["generated_text"]
        if not isinstance(text, str) or not text.startswith("hello world"):
            raise AssertionError(f"pipeline returned {out!r}")

    def do_bf16():
        half = load(folder, dtype=torch.bfloat16)
        ops = {n: p.dtype for n, p in half.named_parameters() if ".ghost." in n}
        if set(ops.values()) != {torch.float32}:
            raise AssertionError(f"operators loaded as {ops}")
        if half.model.embed_tokens.weight.dtype != torch.bfloat16:
            raise AssertionError(f"base weights are {half.model.embed_tokens.weight.dtype}")
        with torch.no_grad():
            logits = half(**inputs).logits
        if not torch.isfinite(logits).all():
            raise AssertionError("bf16 logits not finite")

    def do_missing():
        key = meta["operators"][len(meta["operators"]) // 2]
        broken = work / f"{name}-missing"
        rewrite_checkpoint(folder, broken, drop_tensor(key))
        expect_refusal(load, broken, key)

    def do_tampered():
        key = meta["operators"][0]
        broken = work / f"{name}-tampered"
        rewrite_checkpoint(folder, broken, flip_byte(key))
        expect_refusal(load, broken, key)

    def do_wrong_shape():
        key = meta["operators"][-1]
        broken = work / f"{name}-shape"
        rewrite_checkpoint(folder, broken, grow_tensor(key))
        expect_refusal(load, broken, key)

    def do_resave():
        # Saved again by this version's remote code: the same network, a clean config.json, verified hashes.
        again = work / f"{name}-resaved"
        model.save_pretrained(str(again))
        text = (again / "config.json").read_text()
        if "_ghosted_init_done" in text or "_post_init_done" in text:
            raise AssertionError("config.json holds an internal init marker")
        if not all(b.get("sha256") for b in json.loads(text)["ghost_boundaries"]):
            raise AssertionError("re-saved config.json lacks operator hashes")
        reloaded = load(again)
        with torch.no_grad():
            logits = reloaded(**inputs).logits
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)

    def do_format_version():
        # Saved as the version its boundaries need (1.0, 1.1 with normed terms); every 1.x loads; a newer major
        # version is refused with one line naming it.
        saved = json.loads((folder / "config.json").read_text()).get("ghost_format_version")
        if saved != meta["format_version"]:
            raise AssertionError(f"config.json records ghost_format_version {saved!r}, not {meta['format_version']!r}")
        for version, refused in (("1.7", False), ("2.0", True)):
            marked = work / f"{name}-format-{version}"
            shutil.copytree(folder, marked, dirs_exist_ok=True)
            config = json.loads((marked / "config.json").read_text())
            (marked / "config.json").write_text(json.dumps({**config, "ghost_format_version": version}))
            try:
                load(marked)
            except Exception as exc:  # noqa: BLE001
                if not refused or "Ghosted format 2.0" not in str(exc):
                    raise AssertionError(f"format {version}: {first_line(exc)}") from None
            else:
                if refused:
                    raise AssertionError("a checkpoint of format 2.0 loaded")

    check("config", do_config)
    check("logits", do_logits)
    check("return_tuple", do_return_tuple)
    check("generate_cache", do_generate)
    check("loss", do_loss)
    check("hidden_states", do_hidden_states)
    check("pipeline", do_pipeline)
    check("bf16_fp32_operators", do_bf16)
    check("missing_operator", do_missing)
    check("tampered_operator", do_tampered)
    check("wrong_shape", do_wrong_shape)
    check("resave", do_resave)
    check("format_version", do_format_version)


def main() -> None:
    sys.stdout = sys.stderr
    spec = json.loads(Path(sys.argv[1]).read_text())
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    try:
        import torch
        import transformers

        torch.manual_seed(0)
        torch.set_num_threads(1)
        transformers.logging.set_verbosity_error()
        print(json.dumps({"transformers": transformers.__version__}), file=RESULTS, flush=True)
    except Exception as exc:  # noqa: BLE001
        for name in spec["models"]:
            for check_name in CHECKS:
                emit(name, check_name, False, first_line(exc))
        return
    for name, model_spec in spec["models"].items():
        run_model(name, model_spec, work)
    run_families(spec.get("families", {}))


def skipped_reference(dense, removed: list[int], maps: dict, inputs: dict, layers=None, norm=None):
    """The definition of a ghosted model, computed with a dense model of its family: the `removed` layers pass
    their input through, and `maps[fed]` (a function of the float32 stream) maps the stream entering layer `fed`
    (`len(layers)`: the final norm). `layers` and `norm`: the decoder's, where they are not Llama's
    (`dense.model.layers`, `dense.model.norm`). Shared with tests/test_architectures.py."""
    import torch

    layers, norm = (dense.model.layers, dense.model.norm) if layers is None else (layers, norm)

    def skip(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    def apply(fn):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            mapped = fn(hidden.float()).to(hidden.dtype)
            return ((mapped, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": mapped})
        return hook

    handles = [layers[i].register_forward_hook(skip, with_kwargs=True) for i in removed]
    for fed, fn in maps.items():
        target = layers[fed] if fed < len(layers) else norm
        handles.append(target.register_forward_pre_hook(apply(fn), with_kwargs=True))
    try:
        with torch.no_grad():
            return dense(**inputs, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()


def run_families(families: dict) -> None:
    """Every family of the registry this transformers has: the saved tiny ghosted model loads and equals the
    definition computed with this transformers' own dense model of the family (families whose numerics changed
    between transformers versions included); a family whose dense checkpoint this transformers cannot load
    either is reported as such, and one it does not have as absent."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for model_type, family in families.items():
        if model_type not in CONFIG_MAPPING_NAMES:
            print(json.dumps({"family": model_type, "absent": True}), file=RESULTS, flush=True)
            continue
        folder = Path(family["folder"])
        ref = load_file(str(folder / "reference.safetensors"))
        inputs = {"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"]}
        try:
            # transformers 5 writes the rotary settings as `rope_parameters`, which 4.x does not read: the dense
            # reference reads them as the ghosted model's remote code does (the llama/qwen checks above compare
            # that reading with the current transformers' logits).
            config = AutoConfig.from_pretrained(str(folder / "dense"))
            rope = json.loads((folder / "dense" / "config.json").read_text()).get("rope_parameters")
            if isinstance(rope, dict) and "rope_theta" in rope and hasattr(config, "rope_theta"):
                config.rope_theta = rope["rope_theta"]
            dense = AutoModelForCausalLM.from_pretrained(str(folder / "dense"), config=config).eval()
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"family": model_type, "dense_fails": first_line(exc)}), file=RESULTS, flush=True)
            continue
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder / "ghosted"), trust_remote_code=True).eval()
            with torch.no_grad():
                logits = model(**inputs).logits
            operators = {int(k.split(".")[1]): v for k, v in ref.items() if k.startswith("operator.")}
            maps = {fed: (lambda x, w=operators[first]: x @ w) for first, fed in family["boundaries"]}
            expected = skipped_reference(dense, family["removed"], maps, inputs)
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
        except Exception as exc:  # noqa: BLE001 - every failure is a matrix cell
            if "converts nested models too" in str(exc):  # a clear refusal naming the versions that load it
                emit(model_type, "family_logits", True, "refused with the fix (no conversion of nested layouts)")
                continue
            emit(model_type, "family_logits", False, first_line(exc))
            if os.environ.get("GHOSTED_COMPAT_TRACEBACK"):
                traceback.print_exc(file=sys.stderr)
        else:
            same = torch.allclose(logits, ref["logits"], rtol=0, atol=1e-5 * float(ref["logits"].abs().max()))
            emit(model_type, "family_logits", True, "" if same else "the family's own numerics differ here")


if __name__ == "__main__":
    main()
