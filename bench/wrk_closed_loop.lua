-- wrk script for bench/bench_cloud.py: POST the request bodies named on the command
-- line (after --), in turn, each connection a closed loop (wrk's own model: a
-- connection sends its next request when the answer to the last one is in);
-- print the figures as one JSON line for the benchmark to read.
--
--   wrk -t1 -c32 -d3s -s bench/wrk_closed_loop.lua URL -- CONTENT-TYPE body0 body1 ...

local requests = {}
local n = 0

function init(args)
  local content_type = args[1]
  for i = 2, #args do
    local f = assert(io.open(args[i], "rb"))
    requests[#requests + 1] = wrk.format("POST", nil, {["Content-Type"] = content_type}, f:read("*a"))
    f:close()
  end
end

function request()
  n = n + 1
  return requests[(n % #requests) + 1]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK-RESULT {"requests": %d, "duration_us": %d, "socket_errors": %d, "non_2xx": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
