-- wrk script: POST a ~1 KB JSON body with an Idempotency-Key.
--   MODE=unique (default): a new key per request (thread id + counter), so
--                          every request is a first execution, with a body
--                          of its own (a "seq" field);
--   MODE=replay:           one of 1,000 keys warmed beforehand ("warm-N"),
--                          so every request is a replay;
--   MODE=passthrough:      no key, so idemproxy forwards without protection
--                          (keys are optional by default): the cost of the
--                          proxy itself, without the idempotency work.
-- RUN names the run, keeping unique keys apart between runs.
local counter = 0
local threads = {}
local mode = os.getenv("MODE") or "unique"
local run = os.getenv("RUN") or "run"

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  local items = {}
  for i = 1, 12 do
    items[#items + 1] = string.format(
      '{"sku":"item-%05d","qty":%d,"price":%d.%02d,"tags":["a","b"],"meta":{"note":"line %d"}}',
      i, i % 7 + 1, i * 3, i % 100, i)
  end
  head = '{"customer":"cus_123","currency":"eur","items":[' .. table.concat(items, ",") .. '],"metadata":{"sent_at":"2026-11-30T12:00:00Z"'
  -- Replays repeat the body the keys were warmed with (examples/loadgen.rs).
  replay_body = head .. '}}'
end

-- A first execution's body: like the others but for its own "seq", as
-- distinct operations are. (The same bytes every time would let the proxy
-- reuse one canonical fingerprint for all of them, which real traffic
-- does not allow.)
local function unique_body(seq)
  return head .. ',"seq":"' .. seq .. '"}}'
end

function request()
  counter = counter + 1
  local seq = string.format("%s-%d-%d", run, id, counter)
  if mode == "passthrough" then
    wrk.headers["Idempotency-Key"] = nil
    wrk.body = unique_body(seq)
  elseif mode == "replay" then
    wrk.headers["Idempotency-Key"] = string.format("warm-%d", counter % 1000)
    wrk.body = replay_body
  else
    wrk.headers["Idempotency-Key"] = seq
    wrk.body = unique_body(seq)
  end
  return wrk.format()
end
