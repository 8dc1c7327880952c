-- wrk script: the same ~1 KB JSON body under 1,000 keys warmed beforehand,
-- so every request is a replay.
local counter = 0

function init(args)
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
  wrk.headers["Idempotency-Key"] = string.format("warm-%d", counter % 1000)
  return wrk.format()
end
