import httpx, json
async def test_exp(gateway, bus, fake_worker_heartbeat):
    await fake_worker_heartbeat(bus, "cpu", "x86_64")
    task = "import torch\nclass Model:\n  pass\ndef get_inputs(): return []\ndef get_init_inputs(): return []\n"
    async with httpx.AsyncClient(base_url=gateway) as c:
        for body in [{"op_name":"relu","task_desc":task,"max_rounds":0},{"op_name":"relu"},{"op_name":"relu","task_desc":task,"backend":"tpu"},
                     {"op_name":"relu","task_desc":task,"foo":1},{"op_name":"relu","task_desc":task,"shape_overrides":{"1a":2}},
                     {"op_name":"relu","task_desc":"def (:"},{"op_name":"relu","task_desc":task,"backend":"cuda"},{"op_name":"relu","task_desc":task}, [1]]:
            r = await c.post("/api/v1/jobs/submit", json=body)
            print(r.status_code, r.text)
        r = await c.post("/api/v1/jobs/submit", content=b"{not json", headers={"content-type":"application/json"})
        print(r.status_code, r.text)
        r = await c.post("/api/v1/jobs/submit", content=b"x"*(3<<20), headers={"content-type":"application/json"})
        print(r.status_code, r.text)
        for p in ["/readyz","/api/v1/workers","/api/v1/jobs/nope","/nope","/schema/openapi.json","/schema"]:
            r = await c.get(p); print(p, r.status_code, r.text[:300])
        r = await c.get("/metrics"); print([l for l in r.text.splitlines() if "aikg" in l])
