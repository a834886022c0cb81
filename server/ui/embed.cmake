# embed.cmake — writes OUT, a C file holding IN (server/ui/index.html) as k3_ui_html[] and its
# length, so that `k3 serve` carries its page (GET /) with no file beside the binary.
#   cmake -DIN=server/ui/index.html -DOUT=build/generated/k3_ui_html.c -P server/ui/embed.cmake
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n_hex)
math(EXPR n "${n_hex} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" bytes "${bytes}")
file(WRITE "${OUT}.tmp" "/* generated from server/ui/index.html by server/ui/embed.cmake: do not edit */\n"
     "const char k3_ui_html[] = {\n${bytes}0};\nconst unsigned long k3_ui_html_len = ${n};\n")
file(RENAME "${OUT}.tmp" "${OUT}")
