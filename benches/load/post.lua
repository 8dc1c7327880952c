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
--
-- The load generator shares the machine's cores with what it measures, so
-- every microsecond it spends per request is taken from the proxy under
-- test and dilutes the ratios between targets. As wrk's own docs advise,
-- requests are built cheaply: replays are formatted once in init() and
-- looked up, and a first execution is one string concatenation onto a
-- prefix formatted once (instead of wrk.format, which walks its header
-- table and formats every line for every request).
local counter = 0
local threads = {}
local mode = os.getenv("MODE") or "unique"
local run = os.getenv("RUN") or "run"

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  local items = {}
  for i = 1, 12 do
    items[#items + 1] = string.format(
      '{"sku":"item-%05d","qty":%d,"price":%d.%02d,"tags":["a","b"],"meta":{"note":"line %d"}}',
      i, i % 7 + 1, i * 3, i % 100, i)
  end
  head = '{"customer":"cus_123","currency":"eur","items":[' .. table.concat(items, ",") .. '],"metadata":{"sent_at":"2026-11-30T12:00:00Z"'
  prefix = string.format("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n", wrk.path, wrk.host)
  -- Replays repeat the body the keys were warmed with (examples/loadgen.rs).
  local replay_body = head .. '}}'
  replays = {}
  if mode == "replay" then
    for i = 0, 999 do
      replays[i] = prefix .. "Idempotency-Key: warm-" .. i .. "\r\nContent-Length: " .. #replay_body .. "\r\n\r\n" .. replay_body
    end
  end
end

function request()
  counter = counter + 1
  if mode == "replay" then
    return replays[counter % 1000]
  end
  -- A first execution's body: like the others but for its own "seq", as
  -- distinct operations are. (The same bytes every time would let the
  -- proxy reuse one canonical fingerprint for all of them, which real
  -- traffic does not allow.)
  local seq = run .. "-" .. id .. "-" .. counter
  local body = head .. ',"seq":"' .. seq .. '"}}'
  local key = mode == "passthrough" and "" or "Idempotency-Key: " .. seq .. "\r\n"
  return prefix .. key .. "Content-Length: " .. #body .. "\r\n\r\n" .. body
end
