# cli_test.cmake — checks of the flare program that need more than "exit status 0".
# Run as: cmake -DFLARE=<path to flare> -DMODE=<mode> [-DJSON=<file>] -P cli_test.cmake
#
#   MODE=usage       every bad command line below exits 2 with a one-line message on stderr
#   MODE=bench_json  `flare bench` on the CPU writes a result file in DESIGN.md's schema
#   MODE=no_cuda     `--device cuda` in a build without CUDA kernels exits 1, saying why
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
  foreach(cmdline IN ITEMS "help" "--help" "help demo" "help bench" "demo --help" "bench -h")
    run_flare("${cmdline}")
    if(NOT rc EQUAL 0 OR NOT out MATCHES "usage: flare")
      message(FATAL_ERROR "flare ${cmdline}: exit status ${rc}, expected 0 and usage text")
    endif()
  endforeach()

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
  message(STATUS "${JSON}: ${rows} valid rows")

elseif(MODE STREQUAL "no_cuda")
  run_flare("demo --device cuda --s 64")
  if(NOT rc EQUAL 1 OR NOT err MATCHES "--device cuda: ")
    message(FATAL_ERROR "flare demo --device cuda: exit status ${rc}, stderr: ${err}")
  endif()

else()
  message(FATAL_ERROR "cli_test.cmake: unknown MODE '${MODE}'")
endif()
