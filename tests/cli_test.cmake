# cli_test.cmake — checks of the flare program that need more than "exit status 0".
# Run as: cmake -DFLARE=<path to flare> -DMODE=<mode> [-DJSON=<file>] [-DDIR=<dir>] -P cli_test.cmake
#
#   MODE=usage          every bad command line below exits 2 with a one-line message on stderr;
#                       help lists every command and --version, which prints the version;
#                       bench-dist's help shows both launchers
#   MODE=bench_json     `flare bench` on the CPU writes a result file in the schema of
#                       docs/architecture.md ("Result files"); each case's line is in the piped
#                       output, in order; fixed-length rows carry no "varlen" field
#   MODE=bench_varlen   `flare bench --varlen` runs each case as one packed batch: its lines and
#                       result rows say varlen, mixed lengths with s_q != s_k and GQA run too
#   MODE=bench_mods     `flare bench --softcap X --alibi --dropout P --deterministic`: its lines and result rows
#                       name all three, and a plain run's rows carry none
#   MODE=json_unwritable  --json to a path that cannot be written (DIR: a scratch directory)
#                       fails before any case runs, naming --json and the path
#   MODE=line_buffered  a bench killed while its first case runs has already delivered its
#                       header line through the pipe, and leaves no result file (JSON) behind
#   MODE=no_cuda        `--device cuda` and `bench-dist` in a build without CUDA kernels exit 1,
#                       saying why
cmake_minimum_required(VERSION 3.25)

# Runs flare with the arguments in the string `cmdline`; sets rc, out and err in the caller.
function(run_flare cmdline)
  separate_arguments(args UNIX_COMMAND "${cmdline}")
  execute_process(COMMAND "${FLARE}" ${args} RESULT_VARIABLE r OUTPUT_VARIABLE o ERROR_VARIABLE e)
  set(rc "${r}" PARENT_SCOPE)
  set(out "${o}" PARENT_SCOPE)
  string(STRIP "${e}" e)
  set(err "${e}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "usage")
  set(bad_command_lines
    "frobnicate"
    "demo --no-such-flag"
    "demo --s"
    "demo --s abc"
    "demo --s 12x"
    "demo --s 0"
    "demo --d 257"
    "demo --b -1"
    "demo --dtype fp64"
    "demo --device tpu"
    "demo --causal --no-causal"
    "demo --h 8 --h-kv 3"
    "demo extra"
    "bench --iters 0"
    "bench --warmup -1"
    "bench --pass sideways"
    "bench --causal=yes"
    "bench --json"
    "bench --h-kv 3 --d 64"
    "bench --softcap abc"
    "bench --softcap -1"
    "bench --softcap inf"
    "bench --alibi=yes"
    "bench --dropout -0.1"
    "bench --dropout 1"
    "bench-dist --s 0"
    "bench-dist --s 1024,x"
    "bench-dist --s ,"
    "bench-dist --strategies ring,stripe"
    "bench-dist --h 8 --h-kv 3"
    "bench-dist --causal --no-causal"
    "bench-dist --timeout-s 0"
    "bench-dist --json"
    "bench-dist --gpus 4"
    "help nonsense")
  foreach(cmdline IN LISTS bad_command_lines)
    run_flare("${cmdline}")
    if(NOT rc EQUAL 2)
      message(FATAL_ERROR "flare ${cmdline}: exit status ${rc}, expected 2\n${out}\n${err}")
    endif()
    if(err STREQUAL "" OR err MATCHES "\n")
      message(FATAL_ERROR "flare ${cmdline}: expected a one-line error, got:\n${err}")
    endif()
    message(STATUS "flare ${cmdline} -> 2: ${err}")
  endforeach()
  foreach(cmdline IN ITEMS "help" "--help" "help demo" "help bench" "help bench-dist" "demo --help"
                          "bench -h" "bench-dist --help")
    run_flare("${cmdline}")
    if(NOT rc EQUAL 0 OR NOT out MATCHES "usage: flare")
      message(FATAL_ERROR "flare ${cmdline}: exit status ${rc}, expected 0 and usage text")
    endif()
  endforeach()
  # The top-level help names every way in, --version included.
  run_flare("help")
  foreach(entry IN ITEMS "\n  demo " "\n  bench " "\n  bench-dist " "\n  help " "\n  --version ")
    string(FIND "${out}" "${entry}" at)
    if(at EQUAL -1)
      string(STRIP "${entry}" name)
      message(FATAL_ERROR "flare help does not list '${name}':\n${out}")
    endif()
  endforeach()
  # bench-dist's help says how to launch it both ways.
  run_flare("help bench-dist")
  foreach(entry IN ITEMS "mpirun -np" "torchrun --nproc-per-node" "--json FILE" "per-block sum")
    string(FIND "${out}" "${entry}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "flare help bench-dist does not mention '${entry}':\n${out}")
    endif()
  endforeach()
  run_flare("--version")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "^flare [0-9]+\\.[0-9]+\\.[0-9]+ \\((CUDA|CPU only)\\)\n$")
    message(FATAL_ERROR "flare --version: exit status ${rc}, output '${out}'")
  endif()

elseif(MODE STREQUAL "bench_json")
  file(REMOVE "${JSON}")
  run_flare("bench --device cpu --s 256 --d 64 --warmup 0 --iters 1 --commit test --json ${JSON}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "flare bench: exit status ${rc}\n${out}\n${err}")
  endif()
  file(READ "${JSON}" doc)
  # string(JSON) fails the script on malformed JSON or a missing member.
  foreach(key IN ITEMS card date commit)
    string(JSON value GET "${doc}" ${key})
    if(value STREQUAL "")
      message(FATAL_ERROR "${JSON}: empty \"${key}\"")
    endif()
  endforeach()
  string(JSON commit GET "${doc}" commit)
  string(JSON software_type TYPE "${doc}" software)
  string(JSON rows LENGTH "${doc}" rows)
  if(NOT commit STREQUAL "test" OR NOT software_type STREQUAL "OBJECT")
    message(FATAL_ERROR "${JSON}: commit '${commit}', software is ${software_type}")
  endif()
  # 2 cases (causal and not) × 3 passes.
  if(NOT rows EQUAL 6)
    message(FATAL_ERROR "${JSON}: ${rows} rows, expected 6")
  endif()
  math(EXPR last "${rows} - 1")
  foreach(i RANGE ${last})
    string(JSON impl GET "${doc}" rows ${i} impl)
    string(JSON pass GET "${doc}" rows ${i} pass)
    string(JSON dtype GET "${doc}" rows ${i} dtype)
    string(JSON causal TYPE "${doc}" rows ${i} causal)
    foreach(key IN ITEMS b s_q s_k h h_kv d ms tflops peak_mem_bytes)
      string(JSON value GET "${doc}" rows ${i} ${key})
      if(NOT value GREATER 0)
        message(FATAL_ERROR "${JSON}: rows[${i}].${key} = ${value}, expected > 0")
      endif()
    endforeach()
    string(JSON s_q GET "${doc}" rows ${i} s_q)
    string(JSON d GET "${doc}" rows ${i} d)
    if(NOT impl STREQUAL "flare" OR NOT pass MATCHES "^(fwd|bwd|fwdbwd)$" OR
       NOT dtype STREQUAL "fp32" OR NOT causal STREQUAL "BOOLEAN" OR
       NOT s_q EQUAL 256 OR NOT d EQUAL 64)
      message(FATAL_ERROR "${JSON}: unexpected rows[${i}]: ${impl} ${pass} ${dtype} ${causal} "
                          "s_q=${s_q} d=${d}")
    endif()
  endforeach()
  if(doc MATCHES "varlen")
    message(FATAL_ERROR "${JSON}: a fixed-length run wrote a varlen field:\n${doc}")
  endif()
  message(STATUS "${JSON}: ${rows} valid rows")
  # execute_process reads flare's stdout through a pipe: every (case, pass) line must be there, in
  # the order the cases run (non-causal first), between the header and the closing line.
  set(expected_lines "")
  foreach(mask IN ITEMS "non-causal" "causal")
    foreach(pass IN ITEMS "fwd " "bwd " "fwdbwd")
      list(APPEND expected_lines "${pass} *fp32 b=[0-9]+ +s=256 +h=[0-9]+ +d=64 +${mask} +[0-9.]+ ms")
    endforeach()
  endforeach()
  string(REPLACE "\n" ";" out_lines "${out}")
  list(GET out_lines 0 header)
  if(NOT header MATCHES "^flare .* bench on .*: 2 case\\(s\\)")
    message(FATAL_ERROR "flare bench: first line is not the header: '${header}'")
  endif()
  set(next 1)
  foreach(pattern IN LISTS expected_lines)
    list(LENGTH out_lines count)
    if(next GREATER_EQUAL count)
      message(FATAL_ERROR "flare bench: no line matching '${pattern}' in the piped output:\n${out}")
    endif()
    list(GET out_lines ${next} line)
    if(NOT line MATCHES "^${pattern}")
      message(FATAL_ERROR "flare bench: line ${next} is '${line}', expected '${pattern}'")
    endif()
    math(EXPR next "${next} + 1")
  endforeach()
  list(GET out_lines ${next} line)
  if(NOT line MATCHES "^wrote ")
    message(FATAL_ERROR "flare bench: line ${next} is '${line}', expected 'wrote ${JSON} ...'")
  endif()

elseif(MODE STREQUAL "bench_varlen")
  file(REMOVE "${JSON}")
  # Three sequences of 64, 256 and 448 tokens.
  set(packed "bench --device cpu --s 256 --b 3 --h 2 --d 64 --varlen --warmup 0 --iters 1")
  run_flare("${packed} --commit test --json ${JSON}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "flare bench --varlen: exit status ${rc}\n${out}\n${err}")
  endif()
  file(READ "${JSON}" doc)
  string(JSON rows LENGTH "${doc}" rows)
  if(NOT rows EQUAL 6)
    message(FATAL_ERROR "${JSON}: ${rows} rows, expected 6")
  endif()
  math(EXPR last "${rows} - 1")
  foreach(i RANGE ${last})
    string(JSON varlen_type TYPE "${doc}" rows ${i} varlen)
    string(JSON varlen GET "${doc}" rows ${i} varlen)
    string(JSON b GET "${doc}" rows ${i} b)
    string(JSON s_q GET "${doc}" rows ${i} s_q)
    string(JSON tflops GET "${doc}" rows ${i} tflops)
    if(NOT varlen_type STREQUAL "BOOLEAN" OR NOT varlen OR NOT b EQUAL 3 OR NOT s_q EQUAL 256 OR
       NOT tflops GREATER 0)
      message(FATAL_ERROR "${JSON}: unexpected rows[${i}]: varlen ${varlen_type} ${varlen} b=${b} "
                          "s_q=${s_q} tflops=${tflops}")
    endif()
  endforeach()
  foreach(mask IN ITEMS "non-causal" "causal")
    foreach(pass IN ITEMS "fwd " "bwd " "fwdbwd")
      if(NOT out MATCHES "\n${pass} *fp32 b=3 +s=256 +h=2 +d=64 +${mask} varlen +[0-9.]+ ms")
        message(FATAL_ERROR "flare bench --varlen: no ${pass} ${mask} varlen line in:\n${out}")
      endif()
    endforeach()
  endforeach()
  # Queries shorter than keys (bottom-right causal mask) and grouped heads, packed.
  set(skewed "bench --device cpu --s 100 --s-k 300 --b 4 --h 4 --h-kv 2 --d 32 --causal --varlen")
  run_flare("${skewed} --pass fwdbwd --warmup 0 --iters 1")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "\nfwdbwd fp32 b=4 +s=100/300 +h=4/2 +d=32 +causal varlen ")
    message(FATAL_ERROR "flare bench --varlen --s-k 300: exit status ${rc}\n${out}\n${err}")
  endif()

elseif(MODE STREQUAL "bench_mods")
  file(REMOVE "${JSON}")
  set(mods "bench --device cpu --s 128 --b 2 --h 4 --h-kv 2 --d 32 --causal --softcap 30 --alibi --dropout 0.25 --deterministic")
  run_flare("${mods} --warmup 0 --iters 1 --commit test --json ${JSON}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "flare ${mods}: exit status ${rc}\n${out}\n${err}")
  endif()
  foreach(pass IN ITEMS "fwd " "bwd " "fwdbwd")
    if(NOT out MATCHES "\n${pass} *fp32 b=2 +s=128 +h=4/2 +d=32 +causal softcap alibi dropout deterministic +[0-9.]+ ms")
      message(FATAL_ERROR "flare ${mods}: no ${pass} line naming the modifiers in:\n${out}")
    endif()
  endforeach()
  file(READ "${JSON}" doc)
  string(JSON rows LENGTH "${doc}" rows)
  math(EXPR last "${rows} - 1")
  foreach(i RANGE ${last})
    string(JSON softcap GET "${doc}" rows ${i} softcap)
    string(JSON alibi_type TYPE "${doc}" rows ${i} alibi)
    string(JSON dropout GET "${doc}" rows ${i} dropout)
    string(JSON deterministic GET "${doc}" rows ${i} deterministic)
    if(NOT softcap EQUAL 30 OR NOT alibi_type STREQUAL "BOOLEAN" OR NOT dropout STREQUAL "0.25" OR
       NOT deterministic STREQUAL "ON")
      message(FATAL_ERROR "${JSON}: rows[${i}] softcap ${softcap}, alibi ${alibi_type}, dropout ${dropout}, deterministic ${deterministic}")
    endif()
  endforeach()
  # Without them, rows carry none of the fields (files of plain runs stay as they were).
  run_flare("bench --device cpu --s 64 --b 1 --h 1 --d 32 --causal --pass fwd --warmup 0 --iters 1 --json ${JSON}")
  file(READ "${JSON}" doc)
  foreach(field IN ITEMS softcap alibi dropout deterministic)
    string(JSON plain ERROR_VARIABLE missing GET "${doc}" rows 0 ${field})
    if(NOT missing)
      message(FATAL_ERROR "${JSON}: a plain run's row has ${field} = ${plain}")
    endif()
  endforeach()

elseif(MODE STREQUAL "json_unwritable")
  # A grid that would run for a long time: the check must come before it, so a late check makes
  # the test time out rather than pass.
  set(grid "bench --device cpu --warmup 0 --iters 1000000")
  separate_arguments(grid_args UNIX_COMMAND "${grid}")
  file(REMOVE_RECURSE "${DIR}")
  file(MAKE_DIRECTORY "${DIR}")
  foreach(path IN ITEMS "${DIR}/no-such-directory/result.json" "${DIR}")
    execute_process(COMMAND "${FLARE}" ${grid_args} --json "${path}"
                    TIMEOUT 60 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    string(STRIP "${err}" err)
    if(NOT rc EQUAL 2)
      message(FATAL_ERROR "flare ${grid} --json ${path}: exit status ${rc}, expected 2\n${out}\n${err}")
    endif()
    if(NOT out STREQUAL "")
      message(FATAL_ERROR "flare ${grid} --json ${path}: ran before failing:\n${out}")
    endif()
    string(FIND "${err}" "--json: cannot write '${path}'" at)
    if(at EQUAL -1 OR err MATCHES "\n")
      message(FATAL_ERROR "flare ${grid} --json ${path}: expected one line naming --json and the "
                          "path, got:\n${err}")
    endif()
    message(STATUS "--json ${path} -> 2: ${err}")
  endforeach()
  # bench-dist checks --json before it looks for GPUs or a launch.
  execute_process(COMMAND "${FLARE}" bench-dist --json "${DIR}"
                  TIMEOUT 60 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(FIND "${err}" "--json: cannot write '${DIR}'" at)
  if(NOT rc EQUAL 2 OR at EQUAL -1)
    message(FATAL_ERROR "flare bench-dist --json ${DIR}: exit status ${rc}, expected 2 naming "
                        "--json:\n${out}\n${err}")
  endif()
  file(GLOB left "${DIR}/*")
  if(left)
    message(FATAL_ERROR "the rejected runs left files behind: ${left}")
  endif()

elseif(MODE STREQUAL "line_buffered")
  # The first case's forward alone would take hours, so the run is always killed inside it. By then
  # the header line has been printed; had stdout been buffered until exit, the pipe would be empty.
  file(REMOVE_RECURSE "${DIR}")
  file(MAKE_DIRECTORY "${DIR}")
  execute_process(COMMAND "${FLARE}" bench --device cpu --s 64 --d 32 --warmup 0 --iters 1000000
                          --json "${DIR}/result.json"
                  TIMEOUT 3 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc MATCHES "timeout")
    message(FATAL_ERROR "flare bench was expected to run until killed; exit status ${rc}\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "^flare .* bench on .*\n$")
    message(FATAL_ERROR "flare bench, killed mid-case: expected its header line in the pipe, got '${out}'")
  endif()
  file(GLOB left "${DIR}/*")
  if(left)
    message(FATAL_ERROR "flare bench, killed mid-case, left files behind: ${left}")
  endif()

elseif(MODE STREQUAL "no_cuda")
  run_flare("demo --device cuda --s 64")
  if(NOT rc EQUAL 1 OR NOT err MATCHES "--device cuda: ")
    message(FATAL_ERROR "flare demo --device cuda: exit status ${rc}, stderr: ${err}")
  endif()
  # bench-dist needs GPUs and NCCL: one line saying so, nothing on stdout.
  run_flare("bench-dist --s 1024 --strategies zigzag")
  if(NOT rc EQUAL 1 OR NOT err MATCHES "^flare: bench-dist: .*needs a build with CUDA and NCCL"
     OR err MATCHES "\n" OR NOT out STREQUAL "")
    message(FATAL_ERROR "flare bench-dist without CUDA: exit status ${rc}, stdout '${out}', "
                        "stderr: ${err}")
  endif()

else()
  message(FATAL_ERROR "cli_test.cmake: unknown MODE '${MODE}'")
endif()
