"""KvTransferParams: vLLM's dict to the typed message and back."""

from __future__ import annotations

import logging

from prism.services.worker import kv_transfer

# As NixlConnector hands them back after a prefill (vLLM 0.32).
PREFILLED = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2], [7]],
    "remote_engine_id": "0f3c",
    "remote_request_id": "chatcmpl-1-9a",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 144,
    "remote_prefill_cached_tokens": 16,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_every_field_is_typed_and_survives_the_round_trip():
    message = kv_transfer.to_proto(PREFILLED)
    assert not message.extra
    assert [list(group.ids) for group in message.remote_block_ids] == [[1, 2], [7]]
    assert message.remote_port == 5600 and message.remote_num_tokens == 144
    assert not message.HasField("remote_blocks_expiry_time")
    back = kv_transfer.to_vllm(type(message).FromString(message.SerializeToString()))
    assert back == PREFILLED | {"remote_block_size": None}


def test_optional_fields_keep_their_values():
    params = PREFILLED | {"remote_blocks_expiry_time": 1234.5, "remote_block_size": 16}
    assert kv_transfer.to_vllm(kv_transfer.to_proto(params)) == params


def test_unknown_fields_travel_as_json_and_are_logged(caplog):
    params = PREFILLED | {"remote_shard": {"ranks": [0, 1], "name": "a"}, "flag": True}
    with caplog.at_level(logging.WARNING):
        message = kv_transfer.to_proto(params)
    assert set(message.extra) == {"remote_shard", "flag"}
    assert "remote_shard" in caplog.text
    back = kv_transfer.to_vllm(message)
    assert back["remote_shard"] == {"ranks": [0, 1], "name": "a"} and back["flag"] is True
