def test_info_and_submit(server):
    status, info = server.http("GET", "/v1/info")
    assert status == 200 and info["role"] == "ROLE_LEADER"
    status, body = server.http("POST", "/v1/tasks", {"pool": "default", "payload_json": {"n": 1}})
    assert status == 200 and body["task"]["payload_json"] == {"n": 1}
