"""Speculative decoding through a real CPU server gives the tokens of plain
greedy decoding (spec_decode.py), and a wrong attention would show.

Run by CTest as python_spec_decode_test (tests/python_spec_decode_test.sh):
MLAVERIFY_SERVER names the built server. The server has the model's
geometry: 4 layers, 8 heads, trees up to 16 nodes, 4 items per Verify."""

import json
import os
import subprocess
import tempfile
import time

import pytest
import torch

import spec_decode

SERVER_FLAGS = ["--backend", "cpu", "--cpu-threads", "1", "--layers", "4", "--heads", "8",
                "--page-size", "16", "--pool-bytes", "64MiB",
                "--draft-buckets", "1", "2", "4", "8", "16", "--batch-buckets", "1", "2", "4",
                "--drain-grace-s", "0", "--drain-timeout-s", "2", "--log-level", "warn",
                "--allow-client-shm", "true"]


@pytest.fixture(scope="module")
def server():
    yield from start_server(SERVER_FLAGS)


def start_server(flags):
    binary = os.environ.get("MLAVERIFY_SERVER")
    if not binary or not os.path.exists(binary):
        pytest.fail("MLAVERIFY_SERVER must name the built mlaverify-server (CTest sets it)")
    tmp = tempfile.mkdtemp(prefix="mlaverify-spec-decode-")
    port_file = os.path.join(tmp, "ports")
    log_path = os.path.join(tmp, "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--admin-port", "-1",
                                 "--port-file", port_file, *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while not (os.path.exists(port_file) and os.path.getsize(port_file) > 0):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {open(log_path).read()}")
        time.sleep(0.05)
    yield f"127.0.0.1:{open(port_file).read().split()[0]}"
    proc.terminate()
    assert proc.wait(timeout=20) == 0, open(log_path).read()


@pytest.fixture(scope="module")
def server_61_layers():
    """The production depth (DeepSeek-V3, Kimi K2: 61 layers)."""
    flags = list(SERVER_FLAGS)
    flags[flags.index("--layers") + 1] = "61"
    yield from start_server(flags)


def run(target, *extra):
    args = spec_decode.parser().parse_args(["--target", target, *extra])
    status, report = spec_decode.run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "model"}, indent=1))
    return status, report


def assert_equal_tokens(status, report):
    detail = report["divergence_detail"]
    assert report["divergences"] == 0, f"tokens differ beyond bf16 ties: {detail}"
    assert status == 0
    # Ties end a prompt's comparison early; most tokens must still be compared.
    assert report["tie_divergences"] <= report["prompts"] // 5, detail
    assert report["tokens_compared"] >= 0.75 * report["generated_tokens"], detail


def test_speculative_decoding_gives_greedy_tokens(server):
    status, report = run(server, "--prompts", "20", "--tokens", "32", "--drafts", "10")
    assert report["prompts"] >= 20 and report["tokens_per_prompt"] >= 32
    assert report["generated_tokens"] == 20 * 32
    assert report["drafts_per_tree"] >= 8
    assert_equal_tokens(status, report)
    # Both ends of acceptance happened: a step that kept the whole greedy
    # chain, and one that kept only the root (every draft rolled back).
    assert report["accept_all_steps"] > 0, report["accepted_histogram"]
    assert report["reject_all_steps"] > 0, report["accepted_histogram"]
    # The default drafter (the target's greedy tokens, a quarter of its chain
    # missed) keeps whole stretches: well over one token per step.
    assert report["acceptance_length"] >= 2.5, report["accepted_histogram"]
    # Every step sent every layer, `batch` sequences per call at most.
    assert report["verify_calls"] >= report["steps"] * 4 / report["batch"]


def test_drafts_are_accepted_at_61_layers(server_61_layers):
    # A draft model of the first layers agrees with 61 random layers on
    # almost nothing (about 1.0 token per step); the default drafter keeps
    # accepting, so that the committed rows are exercised at the production
    # depth too.
    status, report = run(server_61_layers, "--prompts", "2", "--tokens", "24")
    assert report["server_layers"] == 61
    assert_equal_tokens(status, report)
    assert report["acceptance_length"] >= 2.5, report["accepted_histogram"]
    assert report["accept_all_steps"] > 0 and report["reject_all_steps"] > 0, \
        report["accepted_histogram"]


def test_system_shared_memory_plane(server):
    status, report = run(server, "--plane", "system-shm", "--prompts", "4", "--tokens", "16")
    assert report["plane"] == "system-shm"
    assert_equal_tokens(status, report)


def test_device_driven_steps_with_host_doorbells(server):
    # One OpenStep per decode step, every layer rung and awaited through host
    # doorbells: the same tokens, with drafts accepted (trees of 10 drafts).
    status, report = run(server, "--plane", "steps", "--prompts", "8", "--tokens", "24")
    assert report["plane"] == "steps"
    assert_equal_tokens(status, report)
    assert report["drafts_accepted_per_step"] > 0 and report["accept_all_steps"] > 0, \
        report["accepted_histogram"]


def test_a_wrong_softmax_scale_changes_the_tokens(server):
    # The server's default scale (1/sqrt(192)) where the model uses 1/sqrt(128):
    # what a scheduler that forgot to pass its scale would get. The check must
    # see it, or equality above would prove nothing.
    status, report = run(server, "--prompts", "4", "--tokens", "16",
                         "--verify-scale", str(1 / 192 ** 0.5))
    assert status == 1
    assert report["divergences"] >= 3, report["divergence_detail"]


def test_committing_the_wrong_rows_changes_the_tokens(server):
    # Each step commits a sibling of its last accepted node: the server then
    # holds the rows of drafts the model did not pick, and later steps attend
    # to them. The comparison must see it, or accepting drafts proves nothing.
    status, report = run(server, "--prompts", "8", "--tokens", "24",
                         "--testing-commit-wrong-path")
    assert report["commit_wrong_path"]
    assert status == 1
    assert report["divergences"] >= 4, report["divergence_detail"]


def test_a_server_of_another_geometry_is_refused(server):
    status, report = run(server, "--layers", "5", "--prompts", "1")
    assert status == 2 and "start it with --layers 5" in report["error"]
    status, report = run(server, "--drafts", "16", "--prompts", "1")
    assert status == 2 and "at most 16" in report["error"]


def test_cuda_shm_plane_needs_a_gpu(server):
    status, report = run(server, "--plane", "cuda-shm", "--prompts", "1")
    assert status == 2
    if spec_decode.cuda_shm_support() is None:
        assert "CUDA shared-memory support" in report["error"]
    else:
        # The plane itself runs against the CUDA server (spec_decode_gpu.sh).
        assert "--device cuda" in report["error"] or "client shared memory" in report["error"]
    if not torch.cuda.is_available():
        pytest.skip("CUDA shm decoding needs a GPU and the CUDA server: "
                    "client/python/examples/spec_decode_gpu.sh runs it")


def test_accept_greedy_takes_the_longest_matching_path():
    # root 0 -> 1 (token 5) -> 3 (token 7) -> 4 (token 9); 0 -> 2 (token 6)
    tree = spec_decode.DraftTree(tokens=[1, 5, 6, 7, 9], parents=[-1, 0, 0, 1, 3],
                                 depth=[0, 1, 1, 2, 3], chain_depth=3)

    def logits(picks):
        out = torch.zeros(len(picks), 16)
        for i, p in enumerate(picks):
            out[i, p] = 1.0
        return out

    # The model picks 5 after the root, 7 after node 1, 2 after node 3: two drafts.
    assert spec_decode.accept_greedy(tree, logits([5, 7, 0, 2, 0])) == ([0, 1, 3], 2)
    # It picks 6: the sibling branch.
    assert spec_decode.accept_greedy(tree, logits([6, 0, 11, 0, 0])) == ([0, 2], 11)
    # Nothing matches: only the root, and the model's pick after it.
    assert spec_decode.accept_greedy(tree, logits([3, 7, 0, 9, 0])) == ([0], 3)
    # The whole chain, and the pick after its leaf.
    assert spec_decode.accept_greedy(tree, logits([5, 7, 0, 9, 4])) == ([0, 1, 3, 4], 4)


def test_draft_trees_have_parents_first_and_the_asked_size():
    model = spec_decode.MlaModel(spec_decode.ModelConfig(num_layers=2, num_heads=2))
    drafter = spec_decode.DraftProposer(model, layers=1, num_drafts=10, chain_depth=5, capacity=64)
    context = list(range(20, 40))
    for step in range(3):
        tree = drafter.propose(context)
        assert len(tree.tokens) == 11 and tree.tokens[0] == context[-1]
        assert tree.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(tree.parents) if i > 0)
        assert max(tree.depth) == tree.chain_depth == 5
        for node in range(len(tree.tokens)):  # siblings carry distinct tokens
            tokens = [tree.tokens[c] for c in tree.children(node)]
            assert len(tokens) == len(set(tokens))
        # The drafter's cache holds the context, not the guessed chain.
        assert drafter.cache.length == len(context)
        context.append(tree.tokens[1])
