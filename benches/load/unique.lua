-- wrk script: POST a ~1 KB JSON body with a unique Idempotency-Key per
-- request (thread id + counter), so every request is a first execution.
local counter = 0
local thread_id = 0
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  thread_id = id
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  local items = {}
  for i = 1, 12 do
    items[#items + 1] = string.format(
      '{"sku":"item-%05d","qty":%d,"price":%d.%02d,"tags":["a","b"],"meta":{"note":"line %d"}}',
      i, i % 7 + 1, i * 3, i % 100, i)
  end
  wrk.body = '{"customer":"cus_123","currency":"eur","items":[' .. table.concat(items, ",") .. '],"metadata":{"sent_at":"2026-11-30T12:00:00Z"}}'
end

function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = string.format("%s-%d-%d", os.getenv("RUN") or "run", thread_id, counter)
  return wrk.format()
end
