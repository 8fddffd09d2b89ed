"""The server batches: requests of different sessions run together, their ticks in shared forwards,
and every session gets exactly what it gets alone."""

import threading
import time

MODEL = "random:tiny"
EOS = {"extra_body": {"ignore_eos": True}}


def converse(server, client_number: int, replies: dict, spans: dict) -> None:
    client, history, said = server.client(), [], []
    session = f"client-{client_number}"
    for request in range(2):
        text = f"marker {client_number}-{request}: tell me about number {client_number * 7 + request}"
        messages = history + [{"role": "user", "content": text}]
        start = time.monotonic()
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, user=session, **EOS)
        spans.setdefault(client_number, []).append((start, time.monotonic()))
        content = reply.choices[0].message.content
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": content}]
        said.append(content)
    replies[client_number] = said


def test_four_clients_at_once_share_forwards_and_each_gets_what_it_gets_alone(tiny, tmp_path, live_server,
                                                                              server_settings):
    clients = range(4)
    alone: dict = {}
    with live_server(tiny, server_settings(tmp_path / "alone")) as server:
        for number in clients:  # one after another: nothing to batch with
            converse(server, number, alone, {})
    together, spans = {}, {}
    with live_server(tiny, server_settings(tmp_path / "together")) as server:
        threads = [threading.Thread(target=converse, args=(server, number, together, spans)) for number in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        meeting = server.server.worker.meeting
        sessions = {number: server.get(f"/v1/sessions/client-{number}").json() for number in clients}
    assert together == alone, "a batched session's replies differ from its replies alone"
    for number, session in sessions.items():  # no mixed sessions: each holds its own markers only
        markers = [f"marker {other}-" in session["transcript"] for other in clients]
        assert markers == [other == number for other in clients]
    # the requests overlapped in time, and their ticks shared forwards
    first_ends = min(end for span in spans.values() for _, end in span)
    assert sum(start < first_ends for span in spans.values() for start, _ in span) >= 2
    assert meeting.fed > meeting.forwards, f"{meeting.fed} sequences fed in {meeting.forwards} forwards: no sharing"
