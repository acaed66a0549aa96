;; The gateway's sample-count guard: a core WebAssembly module that smg runs, as a component, on every
;; request body before it routes the request (deepseek_pd/gateway_guard/__init__.py says why).
;;
;; It answers `reject(400)` when the JSON body holds a key "n" whose value is a number above
;; @MAX_N@ or written with a fraction or exponent, at any depth; otherwise `continue`. Keys are
;; read the way a JSON parser reads them: only outside strings, and "\u006e" is the key "n" too.
;; It also refuses a key "seed" (spelled plainly) whose value is a number, at any depth: smg 1.13
;; drops the seed on its way to the workers, so a request that asks for one is refused rather than
;; silently served unseeded. (A "seed" whose value is an object, as in a tool's JSON schema, passes.)
;;
;; Canonical ABI (component model), as `wasm-tools component new` lifts it:
;;   on-request(req: request) -> action: the record's 13 flat values come as parameters
;;   (7 strings and lists as pointer/length pairs, then now-epoch-ms); the variant result is
;;   written to memory and its address returned. `action` is a u8 case index (0 continue,
;;   1 reject, 2 modify) and, 4-aligned after it, the payload (reject: a u16 status).
;;   cabi_realloc is where the host copies the request's strings and body: a bump allocator,
;;   since the gateway instantiates the component afresh for every call.
(module
  (memory (export "memory") 1)
  (global $heap (mut i32) (i32.const 1024))
  (global $max_n i64 (i64.const @MAX_N@))

  ;; The result of a hook (8 bytes at address 16).
  (func $answer (param $case i32) (param $status i32) (result i32)
    (i32.store8 (i32.const 16) (local.get $case))
    (i32.store16 (i32.const 20) (local.get $status))
    (i32.const 16))

  (func (export "cabi_realloc") (param $old i32) (param $old_size i32) (param $align i32) (param $size i32)
        (result i32)
    (local $ptr i32) (local $end i32) (local $pages i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.sub (local.get $align) (i32.const 1)))
                             (i32.sub (i32.const 0) (local.get $align))))
    (local.set $end (i32.add (local.get $ptr) (local.get $size)))
    (if (i32.lt_u (local.get $end) (local.get $ptr)) (then unreachable))
    (local.set $pages (i32.shr_u (i32.add (local.get $end) (i32.const 65535)) (i32.const 16)))
    (if (i32.gt_u (local.get $pages) (memory.size))
      (then (if (i32.eq (memory.grow (i32.sub (local.get $pages) (memory.size))) (i32.const -1))
              (then unreachable))))
    (if (local.get $old)
      (then (memory.copy (local.get $ptr) (local.get $old)
                         (select (local.get $old_size) (local.get $size)
                                 (i32.lt_u (local.get $old_size) (local.get $size))))))
    (global.set $heap (local.get $end))
    (local.get $ptr))

  ;; JSON whitespace: space, tab, line feed, carriage return.
  (func $skip_space (param $i i32) (param $end i32) (result i32)
    (local $c i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $end)))
        (local.set $c (i32.load8_u (local.get $i)))
        (br_if $done (i32.eqz (i32.or (i32.or (i32.eq (local.get $c) (i32.const 0x20))
                                              (i32.eq (local.get $c) (i32.const 0x09)))
                                      (i32.or (i32.eq (local.get $c) (i32.const 0x0a))
                                              (i32.eq (local.get $c) (i32.const 0x0d))))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (local.get $i))

  ;; Whether the string content [a, b) (between the quotes, still escaped) decodes to "n":
  ;; the byte n, or the escape \u006e / \u006E (no other escape decodes to n).
  (func $is_n (param $a i32) (param $b i32) (result i32)
    (local $len i32) (local $tail i32)
    (local.set $len (i32.sub (local.get $b) (local.get $a)))
    (if (i32.eq (local.get $len) (i32.const 1))
      (then (return (i32.eq (i32.load8_u (local.get $a)) (i32.const 0x6e)))))
    (if (i32.eq (local.get $len) (i32.const 6))
      (then
        (local.set $tail (i32.load16_u offset=4 (local.get $a)))
        (return (i32.and (i32.eq (i32.load (local.get $a)) (i32.const 0x3030755c))        ;; "\u00"
                         (i32.or (i32.eq (local.get $tail) (i32.const 0x6536))             ;; "6e"
                                 (i32.eq (local.get $tail) (i32.const 0x4536)))))))        ;; "6E"
    (i32.const 0))

  ;; After a string that ended just before `i`: 1 when it is an object key whose value is a number
  ;; above $max_n or not a plain integer, else 0.
  (func $value_too_big (param $i i32) (param $end i32) (result i32)
    (local $c i32) (local $value i64) (local $digits i32)
    (local.set $i (call $skip_space (local.get $i) (local.get $end)))
    (if (i32.ge_u (local.get $i) (local.get $end)) (then (return (i32.const 0))))
    (if (i32.ne (i32.load8_u (local.get $i)) (i32.const 0x3a)) (then (return (i32.const 0))))  ;; not a key
    (local.set $i (call $skip_space (i32.add (local.get $i) (i32.const 1)) (local.get $end)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $end)))
        (local.set $c (i32.sub (i32.load8_u (local.get $i)) (i32.const 0x30)))
        (br_if $done (i32.gt_u (local.get $c) (i32.const 9)))
        (local.set $value (i64.add (i64.mul (local.get $value) (i64.const 10)) (i64.extend_i32_u (local.get $c))))
        (if (i64.gt_u (local.get $value) (global.get $max_n)) (then (return (i32.const 1))))
        (local.set $digits (i32.add (local.get $digits) (i32.const 1)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (if (i32.eqz (local.get $digits)) (then (return (i32.const 0))))  ;; a string, object, sign...: not ours
    (if (i32.ge_u (local.get $i) (local.get $end)) (then (return (i32.const 0))))
    (local.set $c (i32.load8_u (local.get $i)))
    (i32.or (i32.eq (local.get $c) (i32.const 0x2e))                   ;; 1.5, 2.0
            (i32.eq (i32.or (local.get $c) (i32.const 0x20)) (i32.const 0x65))))  ;; 1e6, 1E6

  ;; Whether the string content [a, b) is the key "seed" (plain bytes: the refusal is a courtesy
  ;; to a client whose seed would be dropped, not a bound someone must not evade).
  (func $is_seed (param $a i32) (param $b i32) (result i32)
    (i32.and (i32.eq (i32.sub (local.get $b) (local.get $a)) (i32.const 4))
             (i32.eq (i32.load (local.get $a)) (i32.const 0x64656573))))       ;; "seed"

  ;; After a string that ended just before `i`: 1 when it is an object key whose value is a number.
  (func $number_value (param $i i32) (param $end i32) (result i32)
    (local $c i32)
    (local.set $i (call $skip_space (local.get $i) (local.get $end)))
    (if (i32.ge_u (local.get $i) (local.get $end)) (then (return (i32.const 0))))
    (if (i32.ne (i32.load8_u (local.get $i)) (i32.const 0x3a)) (then (return (i32.const 0))))  ;; not a key
    (local.set $i (call $skip_space (i32.add (local.get $i) (i32.const 1)) (local.get $end)))
    (if (i32.ge_u (local.get $i) (local.get $end)) (then (return (i32.const 0))))
    (local.set $c (i32.load8_u (local.get $i)))
    (i32.or (i32.eq (local.get $c) (i32.const 0x2d))                                ;; -
            (i32.le_u (i32.sub (local.get $c) (i32.const 0x30)) (i32.const 9))))    ;; 0-9

  ;; 1 when the body asks for too many samples or for a seed (see the top of this file).
  (func $too_many_samples (param $i i32) (param $len i32) (result i32)
    (local $end i32) (local $c i32) (local $in_string i32) (local $escaped i32) (local $start i32)
    (local.set $end (i32.add (local.get $i) (local.get $len)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $end)))
        (local.set $c (i32.load8_u (local.get $i)))
        (block $seen
          (if (i32.eqz (local.get $in_string))
            (then
              (if (i32.eq (local.get $c) (i32.const 0x22))                ;; a string opens
                (then (local.set $in_string (i32.const 1))
                      (local.set $start (local.get $i))))
              (br $seen)))
          (if (local.get $escaped)
            (then (local.set $escaped (i32.const 0))
                  (br $seen)))
          (if (i32.eq (local.get $c) (i32.const 0x5c))                    ;; backslash
            (then (local.set $escaped (i32.const 1))
                  (br $seen)))
          (br_if $seen (i32.ne (local.get $c) (i32.const 0x22)))
          (local.set $in_string (i32.const 0))                            ;; the string closes
          (if (call $is_seed (i32.add (local.get $start) (i32.const 1)) (local.get $i))
            (then (if (call $number_value (i32.add (local.get $i) (i32.const 1)) (local.get $end))
                    (then (return (i32.const 1))))))
          (br_if $seen (i32.eqz (call $is_n (i32.add (local.get $start) (i32.const 1)) (local.get $i))))
          (if (call $value_too_big (i32.add (local.get $i) (i32.const 1)) (local.get $end))
            (then (return (i32.const 1)))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (i32.const 0))

  (func (export "smg:gateway/middleware-on-request#on-request")
        (param $method i32) (param $method_len i32) (param $path i32) (param $path_len i32)
        (param $query i32) (param $query_len i32) (param $headers i32) (param $headers_len i32)
        (param $body i32) (param $body_len i32) (param $request_id i32) (param $request_id_len i32)
        (param $now_epoch_ms i64) (result i32)
    (if (result i32) (call $too_many_samples (local.get $body) (local.get $body_len))
      (then (call $answer (i32.const 1) (i32.const 400)))
      (else (call $answer (i32.const 0) (i32.const 0)))))

  (func (export "smg:gateway/middleware-on-response#on-response")
        (param $status i32) (param $headers i32) (param $headers_len i32) (param $body i32) (param $body_len i32)
        (result i32)
    (call $answer (i32.const 0) (i32.const 0))))
