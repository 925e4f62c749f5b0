"""Chat: messages are rendered with the model's template and tokenized once, in the router, so
the tokens it hashes are the tokens the worker caches — each turn reuses the history's blocks."""

from __future__ import annotations

from kvfleet.client import Client

SYSTEM = ("You are the reference desk of a small public library. Answer in one or two short "
          "sentences, name the shelf where the book can be found, and never invent titles.")
QUESTIONS = ["Where are the atlases?", "And the books about volcanoes?",
             "Which shelf has the old newspapers?"]


def test_a_three_turn_conversation_reuses_its_history_on_every_turn(tiny_cluster):
    messages = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    replicas = set()
    with Client(tiny_cluster.router_address) as client:
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            chunks = list(client.stream(messages=messages, max_tokens=6, ignore_eos=True,
                                        cache_salt="three-turn-chat"))
            last = chunks[-1]
            if turn > 0:
                # Every full block of the previous turn's prompt is a prefix of this one.
                assert last.cached_prompt_tokens >= (previous_prompt // 16) * 16 > 0
            replicas.add(last.replica_id)
            previous_prompt = last.prompt_tokens
            messages.append({"role": "assistant", "content": "".join(c.text for c in chunks)})
    assert len(replicas) == 1  # the conversation stays where its history is cached
