"""Ring attention keeps a rank's saved activations proportional to its share of the sequence."""

SEQ_LEN = 528  # debug flavor: 16 image tokens (3%) + 512 text tokens
TEXT_LEN = 512


def test_p2p_saves_a_quarter_at_cp4_and_never_the_whole_sequence(pool):
    cp1 = pool.run("saved_for_backward", cp=1, seq_len=SEQ_LEN)[0]
    ratios = {}
    for comm in ("p2p", "allgather", "a2a"):
        per_rank = pool.run("saved_for_backward", cp=4, comm=comm, seq_len=SEQ_LEN)
        ratios[comm] = max(r["bytes"] for r in per_rank) / cp1["bytes"]
        longest = max(r["longest_dim"] for r in per_rank)
        print(
            f"cp=4 {comm}: saved-for-backward {ratios[comm]:.3f} x cp=1, "
            f"longest saved dim {longest}"
        )
        if comm == "p2p":
            assert longest < TEXT_LEN, "a p2p rank saved a tensor as long as the whole text"
        if comm == "allgather":  # the control: gathering the K/V does keep whole-sequence tensors
            assert longest >= TEXT_LEN
    assert ratios["p2p"] <= 0.35
    assert cp1["longest_dim"] >= TEXT_LEN


def test_activation_checkpointing_saves_less(pool):
    none, selective, full = (
        pool.run("saved_for_backward", cp=2, seq_len=SEQ_LEN, ac=ac)[0]["bytes"]
        for ac in ("none", "selective", "full")
    )
    print(
        f"cp=2 saved-for-backward MiB: none {none / 2**20:.1f}, selective {selective / 2**20:.1f}, "
        f"full {full / 2**20:.1f}"
    )
    assert full < 0.5 * none and full < selective < none
